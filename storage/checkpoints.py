"""Checkpoints: `OUTPUT_DIR/checkpoints/step=NNNNNN/<component>/` files + a manifest written last.

The trainer's checkpoint (component `trainer`) is laid out here once: engines/trainer/checkpoint.py writes
and restores it, storage/resume.py reads it back to rewrite a corrupt publication.
"""

from __future__ import annotations

import fsspec

from storage.fs import (
    MANIFEST,
    commit_dir,
    committed_steps,
    join,
    read_manifest,
    read_verified,
    sha256,
    step_dir,
)
from storage.weights import WEIGHTS_FILE as WEIGHTS

TRAINER = "trainer"  # the trainer's component directory under each checkpoint step
# The trainer checkpoint's own files; every other file in it is a Hugging Face file kept beside the weights
# (config.json, generation_config.json, tokenizer files), so the directory loads as a model.
WEIGHTS_FILE = WEIGHTS  # the full weights, as in a publication
TRAINER_STATE_FILE = "trainer_state.pt"  # torch.save of the step and the non-optimizer parts (scheduler, RNG, ...)
RUN_STATE_FILE = "run_state.json"  # run-level progress: committed rollout steps, prompt cursor, MLflow run
OPTIMIZER_DIR = "optimizer"  # torch.distributed.checkpoint files of the optimizer state, one per rank + .metadata


def hf_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """Of a trainer checkpoint's files, the Hugging Face ones kept beside the weights."""
    own = (WEIGHTS_FILE, TRAINER_STATE_FILE, RUN_STATE_FILE)
    return {k: v for k, v in files.items() if k not in own and not k.startswith(f"{OPTIMIZER_DIR}/")}


def checkpoints_root(output_root: str) -> str:
    return join(output_root, "checkpoints")


def step_path(output_root: str, step: int, component: str) -> str:
    return join(step_dir(checkpoints_root(output_root), step), component)


def uncommit(fs: fsspec.AbstractFileSystem, directory: str) -> None:
    """Remove a directory's manifest before files are written into it by other processes (DCP shards)."""
    path = join(directory, MANIFEST)
    if fs.exists(path):
        fs.rm(path)


def save(
    fs: fsspec.AbstractFileSystem,
    output_root: str,
    step: int,
    component: str,
    files: dict[str, bytes],
    written: list[str] | None = None,
) -> str:
    """Write `files` and commit them with `written` (names, relative to the directory, that other writers
    already put there): each is read back and checksummed into the manifest, which is written last."""
    directory = step_path(output_root, step, component)
    entries = {}
    for name in written or []:
        data = fs.cat_file(join(directory, name))
        entries[name] = {"bytes": len(data), "sha256": sha256(data)}
    commit_dir(fs, directory, files, {"step": step, "component": component}, written=entries)
    return directory


def manifest(fs: fsspec.AbstractFileSystem, output_root: str, step: int, component: str) -> dict:
    return read_manifest(fs, step_path(output_root, step, component))


def load(fs: fsspec.AbstractFileSystem, output_root: str, step: int, component: str) -> dict[str, bytes]:
    directory = step_path(output_root, step, component)
    m = read_manifest(fs, directory)
    return {name: read_verified(fs, directory, name, m) for name in m["files"]}


def checkpoint_steps(fs: fsspec.AbstractFileSystem, output_root: str, component: str = TRAINER) -> list[int]:
    """Steps whose `component` checkpoint is committed, ascending."""
    return committed_steps(fs, checkpoints_root(output_root), component)
