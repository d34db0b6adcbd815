"""Retention: which weight publications and checkpoints to delete, and deleting them safely.

Rollout shards are never deleted. By default nothing is (every `keep_*` setting is None). With
`storage.keep_last_weights` / `keep_every_weights` and `keep_last_checkpoints` / `keep_every_checkpoints`
set, the writer (the trainer, after each publication and checkpoint) calls `enforce`, which keeps:

- the newest `keep_last_*` committed entries, and those whose step is a multiple of `keep_every_*`;
- always the newest complete checkpoint C (a resume restarts from it);
- always the publication at C and every publication newer than C (a resume deletes and regenerates
  those newer ones itself), or publication 0 when there is no checkpoint yet; and the publication at
  every other kept checkpoint (a resume falls back to an older checkpoint when the newest is corrupt);
- every publication a kept delta publication is rebuilt from (its `base_version` chain).

The decisions are pure functions over lists of committed steps (`checkpoints_to_keep`,
`weights_to_keep`); `apply` deletes each victim's manifest first, so a reader sees it either committed
and whole or not committed at all, then its files. Directories without a manifest (a write in progress)
are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import fsspec

from config.storage import StorageConfig
from storage import checkpoints
from storage.fs import (
    MANIFEST,
    committed_steps,
    fs_settings,
    join,
    read_manifest,
    remove_committed,
    step_dir,
)

log = logging.getLogger("rollflow.storage")


def _last_and_every(steps: list[int], keep_last: int, keep_every: int | None) -> set[int]:
    keep = set(sorted(steps)[-keep_last:])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def checkpoints_to_keep(steps: list[int], keep_last: int | None, keep_every: int | None = None) -> set[int]:
    """Committed checkpoint steps to keep; the newest is always among them."""
    if keep_last is None:
        return set(steps)
    return _last_and_every(steps, max(keep_last, 1), keep_every)


def weights_to_keep(
    versions: list[int],
    newest_checkpoint: int | None,
    keep_last: int | None,
    keep_every: int | None = None,
    base_of: Callable[[int], int | None] = lambda v: None,
    kept_checkpoints: Iterable[int] = (),
) -> set[int]:
    """Committed publication versions to keep (see the module docstring); `base_of(v)` is the version a
    delta publication is rebuilt from, None for a full one. The publication at every kept checkpoint
    stays too: a resume falls back to an older checkpoint when the newest one is corrupt."""
    if keep_last is None:
        return set(versions)
    keep = _last_and_every(versions, max(keep_last, 1), keep_every)
    if newest_checkpoint is None:
        keep |= {v for v in versions if v == 0}
    else:
        keep |= {v for v in versions if v >= newest_checkpoint}
    keep |= set(versions) & set(kept_checkpoints)
    todo = sorted(keep)
    while todo:  # close over delta bases: a kept delta is useless without its chain
        base = base_of(todo.pop())
        if base is not None and base not in keep:
            keep.add(base)
            todo.append(base)
    return keep


@dataclass
class Plan:
    weights: list[int]
    checkpoints: list[int]


def _base_reader(fs: fsspec.AbstractFileSystem, root: str, bases: dict[int, int | None]) -> Callable[[int], int | None]:
    """`base_of` reading manifests once: `bases` (version -> base_version) is the caller's memo, which a
    publisher fills as it commits, so retention need not read those manifests back."""

    def base_of(version: int) -> int | None:
        if version not in bases:
            base = read_manifest(fs, step_dir(join(root, "weights"), version)).get("base_version")
            bases[version] = None if base is None else int(base)
        return bases[version]

    return base_of


def plan(
    fs: fsspec.AbstractFileSystem,
    root: str,
    s: StorageConfig | None = None,
    bases: dict[int, int | None] | None = None,
) -> Plan:
    """What `enforce` would delete under `root`, from the committed steps and the settings (by default
    those `fs` carries)."""
    s = s or fs_settings(fs)
    ckpts = checkpoints.checkpoint_steps(fs, root)
    keep_c = checkpoints_to_keep(ckpts, s.keep_last_checkpoints, s.keep_every_checkpoints)
    newest = ckpts[-1] if ckpts else None
    versions = committed_steps(fs, join(root, "weights"))
    keep_w = weights_to_keep(
        versions,
        newest,
        s.keep_last_weights,
        s.keep_every_weights,
        _base_reader(fs, root, {} if bases is None else bases),
        keep_c,
    )
    return Plan(weights=[v for v in versions if v not in keep_w], checkpoints=[c for c in ckpts if c not in keep_c])


def apply(fs: fsspec.AbstractFileSystem, root: str, p: Plan) -> None:
    for v in p.weights:
        directory = step_dir(join(root, "weights"), v)
        remove_committed(fs, directory, [join(directory, MANIFEST)])
    for c in p.checkpoints:
        directory = step_dir(join(root, "checkpoints"), c)
        components = [e for e in fs.ls(directory, detail=False) if not e.rstrip("/").endswith(MANIFEST)]
        remove_committed(fs, directory, [join(e, MANIFEST) for e in components])
    if p.weights or p.checkpoints:
        log.info(f"retention: deleted weight publications {p.weights} and checkpoints {p.checkpoints}")


def enforce(
    fs: fsspec.AbstractFileSystem,
    root: str,
    s: StorageConfig | None = None,
    bases: dict[int, int | None] | None = None,
) -> Plan:
    """Apply the configured retention under `root`; a no-op (no listing at all) when nothing is limited.
    The writer that decides (the trainer, after each publication and checkpoint) calls it."""
    s = s or fs_settings(fs)
    if s.keep_last_weights is None and s.keep_last_checkpoints is None:
        return Plan([], [])
    p = plan(fs, root, s, bases)
    apply(fs, root, p)
    return p
