"""Filesystem access and the manifest-last commit protocol shared by shards, weights and checkpoints.

A directory is *committed* when its `_manifest.json` exists: the manifest is written after every file
it lists, and lists each file's size and sha256. Readers trust only what a manifest lists and verify
checksums, so a reader never sees a half-written directory, on a local disk or on an object store
(which has no atomic rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

MANIFEST = "_manifest.json"


class CorruptError(IOError):
    """A committed file does not match its manifest (truncated, corrupted or missing)."""


def get_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Whole-or-nothing write: temp file + rename locally; a single PUT (atomic per object) elsewhere."""
    parent, name = path.rsplit("/", 1)
    fs.makedirs(parent, exist_ok=True)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    # A leading '.' keeps a crash's leftover out of Arrow dataset discovery (it skips '.' and '_').
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex[:8]}-{name}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def commit_dir(fs: fsspec.AbstractFileSystem, directory: str, files: dict[str, bytes], meta: dict) -> dict:
    """Write `files` into `directory`, then the manifest that commits them. Returns the manifest.

    Rewriting a committed directory first removes its manifest, so no reader ever pairs the old
    manifest with new files.
    """
    manifest_path = join(directory, MANIFEST)
    if fs.exists(manifest_path):
        fs.rm(manifest_path)
    entries = {}
    for name, data in files.items():
        write_bytes_atomic(fs, join(directory, name), data)
        entries[name] = {"bytes": len(data), "sha256": sha256(data)}
    manifest = {**meta, "files": entries}
    write_bytes_atomic(fs, manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest


def is_committed(fs: fsspec.AbstractFileSystem, directory: str) -> bool:
    fs.invalidate_cache(directory)  # object-store listings are cached; commits by other processes must show
    return fs.exists(join(directory, MANIFEST))


def read_manifest(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, Any]:
    path = join(directory, MANIFEST)
    try:
        return json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptError(f"{path}: manifest is not valid JSON ({exc})") from exc


def read_verified(fs: fsspec.AbstractFileSystem, directory: str, name: str, manifest: dict) -> bytes:
    """Read one committed file and check it against its manifest entry."""
    path = join(directory, name)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CorruptError(f"{path}: not listed in {join(directory, MANIFEST)}")
    try:
        data = fs.cat_file(path)
    except FileNotFoundError as exc:
        raise CorruptError(f"{path}: listed in the manifest but missing") from exc
    if len(data) != entry["bytes"] or sha256(data) != entry["sha256"]:
        raise CorruptError(
            f"{path}: checksum mismatch ({len(data)} bytes, manifest says {entry['bytes']}); "
            "the file is truncated or corrupted"
        )
    return data


def committed_steps(fs: fsspec.AbstractFileSystem, parent: str, sub: str = "") -> list[int]:
    """Steps `N` for which `parent/step=N/<sub>` is committed, ascending."""
    fs.invalidate_cache(parent)
    if not fs.exists(parent):
        return []
    steps = []
    for entry in fs.ls(parent, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step=") and is_committed(fs, join(entry, sub)):
            steps.append(int(name.split("=", 1)[1]))
    return sorted(steps)


def step_dir(parent: str, step: int) -> str:
    return join(parent, f"step={step:06d}")


def read_json(url: str) -> Any:
    """Read a JSON document from a local path or any fsspec URL (component configs travel this way)."""
    with fsspec.open(url, "rb") as f:
        return json.loads(f.read())


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    write_bytes_atomic(fs, path, (json.dumps(obj, indent=2) + "\n").encode())
