"""Checkpoints: `OUTPUT_DIR/checkpoints/step=NNNNNN/<component>/` files + a manifest written last."""

from __future__ import annotations

import fsspec

from storage.fs import commit_dir, committed_steps, join, read_manifest, read_verified, step_dir


def checkpoints_root(output_root: str) -> str:
    return join(output_root, "checkpoints")


def save(fs: fsspec.AbstractFileSystem, output_root: str, step: int, component: str, files: dict[str, bytes]) -> str:
    directory = join(step_dir(checkpoints_root(output_root), step), component)
    commit_dir(fs, directory, files, {"step": step, "component": component})
    return directory


def load(fs: fsspec.AbstractFileSystem, output_root: str, step: int, component: str) -> dict[str, bytes]:
    directory = join(step_dir(checkpoints_root(output_root), step), component)
    manifest = read_manifest(fs, directory)
    return {name: read_verified(fs, directory, name, manifest) for name in manifest["files"]}


def checkpoint_steps(fs: fsspec.AbstractFileSystem, output_root: str, component: str = "trainer") -> list[int]:
    """Steps whose `component` checkpoint is committed, ascending."""
    return committed_steps(fs, checkpoints_root(output_root), component)
