"""Weight publications: `OUTPUT_DIR/weights/step=NNNNNN/model.safetensors` + manifest written last.

Version N is the policy after trainer step N (version 0 = initial weights, after the warm-up). The
trainer publishes, the orchestrator discovers new versions and tells the inference engine to load them.
"""

from __future__ import annotations

import fsspec

from storage.fs import commit_dir, committed_steps, join, read_manifest, read_verified, step_dir

WEIGHTS_FILE = "model.safetensors"


def weights_root(output_root: str) -> str:
    return join(output_root, "weights")


def version_dir(output_root: str, version: int) -> str:
    return step_dir(weights_root(output_root), version)


def publish(fs: fsspec.AbstractFileSystem, output_root: str, version: int, state_dict: dict) -> str:
    """Serialize and commit a state dict as policy `version`; returns the publication's directory."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    directory = version_dir(output_root, version)
    commit_dir(fs, directory, {WEIGHTS_FILE: save(tensors)}, {"version": version})
    return directory


def latest_version(fs: fsspec.AbstractFileSystem, output_root: str) -> int | None:
    versions = committed_steps(fs, weights_root(output_root))
    return versions[-1] if versions else None


def read_version(fs: fsspec.AbstractFileSystem, directory: str) -> int:
    """The policy version a committed publication declares in its manifest."""
    return int(read_manifest(fs, directory)["version"])


def load(fs: fsspec.AbstractFileSystem, directory: str) -> dict:
    """Load a committed publication (checksum-verified) as a CPU state dict."""
    from safetensors.torch import load as st_load

    manifest = read_manifest(fs, directory)
    return st_load(read_verified(fs, directory, WEIGHTS_FILE, manifest))


def load_latest(fs: fsspec.AbstractFileSystem, output_root: str) -> tuple[int, dict] | None:
    """(version, state dict) of the newest committed publication, or None when there is none."""
    version = latest_version(fs, output_root)
    if version is None:
        return None
    return version, load(fs, version_dir(output_root, version))
