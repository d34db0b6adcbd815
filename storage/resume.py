"""Pick the point a run restarts from and roll the run directory back to it.

The resume point is the newest trainer checkpoint whose files all match their manifest's checksums;
a corrupt one is reported by path and the previous one is tried. Rolling back to checkpoint C:
- weight publications newer than C are removed (the resumed trainer publishes them again, so the
  engine never serves a policy from the abandoned line);
- metrics rows after C are removed (the trainer records those steps again: each appears once);
- evaluations during RL (evals/online/version=V) of versions after C are removed (redone when the new V is
  served), unfinished ones of versions before C too (that policy is never served again), V = C is continued;
- directories without a manifest (a write cut short by the failure) are removed everywhere;
- committed rollout steps are all kept: they are valid samples within the staleness bound, and
  throwing them away is what loses buffered rollouts in other frameworks.
`repair` then checks what the restarted components will read first: the rollout steps after C (a
corrupt one is reported by path and removed, so the orchestrator samples that step again) and the
publication the engine will load (a corrupt one is rewritten from the checkpoint's copy of the weights).
"""

from __future__ import annotations

from collections.abc import Callable

import fsspec

from storage import checkpoints, evals, rollouts, weights
from storage.fs import MANIFEST, CorruptError, join, remove_committed, step_dirs
from storage.metrics import MetricsLog


def resume_point(fs: fsspec.AbstractFileSystem, root: str, log: Callable[[str], None]) -> int | None:
    """Step of the newest complete, checksum-verified trainer checkpoint; None when there is none."""
    for step in reversed(checkpoints.checkpoint_steps(fs, root)):
        try:
            checkpoints.load(fs, root, step, checkpoints.TRAINER)
            return step
        except CorruptError as exc:
            log(f"checkpoint step={step} is unusable: {exc}; falling back to the previous checkpoint")
    return None


def _has_manifest(fs: fsspec.AbstractFileSystem, directory: str, sub: str = "") -> bool:
    return fs.exists(join(directory, sub, MANIFEST))


def rollback(fs: fsspec.AbstractFileSystem, root: str, step: int | None) -> list[str]:
    """Make the run directory consistent with checkpoint `step` (None: the warm-up's version 0).

    Returns what was removed, for the log.
    """
    keep_up_to = step or 0
    removed = []
    for version, directory in step_dirs(fs, weights.weights_root(root)).items():
        if version > keep_up_to or not _has_manifest(fs, directory):
            remove_committed(fs, directory)
            removed.append(directory)
    for _, directory in step_dirs(fs, rollouts.rollouts_root(root)).items():
        if not _has_manifest(fs, directory):
            remove_committed(fs, directory)
            removed.append(directory)
    for _, directory in step_dirs(fs, checkpoints.checkpoints_root(root)).items():
        if not _has_manifest(fs, directory, checkpoints.TRAINER):
            fs.rm(directory, recursive=True)
            removed.append(directory)
    for version in evals.online_versions(fs, root, finished=False):
        # past the checkpoint: the policy is trained again, so is its eval; before it, unfinished: that policy is
        # not served again (discarded); at it: continued
        finished = evals.read_summary(fs, evals.online_dir(root, version)) is not None
        if version > keep_up_to or (version < keep_up_to and not finished):
            evals.remove(fs, evals.online_dir(root, version))
            removed.append(evals.online_dir(root, version))
    metrics = MetricsLog(fs, root)
    if metrics.last_step is not None and metrics.last_step > keep_up_to:
        metrics.truncate_after(keep_up_to)
        removed.append(f"{metrics.path} rows after step {keep_up_to}")
    return removed


def repair(fs: fsspec.AbstractFileSystem, root: str, step: int | None, log: Callable[[str], None]) -> None:
    """Verify what a restart from checkpoint `step` reads first; fix what can be fixed, say what was found."""
    start = step or 0
    for later in rollouts.committed_rollout_steps(fs, root):
        if later <= start:
            continue
        try:
            rollouts.read_step(fs, root, later)
        except CorruptError as exc:
            log(f"rollout step {later} is corrupt: {exc}; removing it so it is sampled again")
            remove_committed(fs, rollouts.step_path(root, later))
    directory = weights.version_dir(root, start)
    if not fs.exists(join(directory, MANIFEST)):
        return
    try:
        weights.load(fs, directory)  # verifies a full publication, or rebuilds a delta one against its checksum
    except CorruptError as exc:
        if step is None:
            log(f"policy version 0 is corrupt: {exc}; removing it so the warm-up runs again")
            remove_committed(fs, directory)
            return
        log(f"policy version {step} is corrupt: {exc}; rewriting it from checkpoint step={step}")
        from safetensors.torch import load as st_load

        files = checkpoints.load(fs, root, step, checkpoints.TRAINER)
        state = st_load(files[checkpoints.WEIGHTS_FILE])
        # full: this process has no delta base
        weights.publish(fs, root, step, state, checkpoints.hf_files(files))
