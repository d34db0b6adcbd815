"""Fencing: every commit under a run directory is conditional on the writer's flow still holding the run's lease.

The flow that acquires the lease (runtime/lease.py) installs a `Fence` (run root, lease owner, generation) in
its own process and exports it as $ROLLFLOW_FENCE, which every component it starts inherits. Every atomic
write and every removal of a committed directory under that root (storage/fs.py `write_bytes_atomic`,
`remove_committed`) first calls `check`: it reads `lease.json` and raises `LeaseLost` unless it still names
this owner and generation. In the flow's process it also refuses once the lease is known lost or its renewal
deadline passed. A second flow that took the run over thus makes the first one's next commit fail, in any of
its processes, so the two never interleave commits.

A process that writes for several runs in turn (the shared trainer of a multi-tenant deployment, one step of
one tenant at a time) cannot inherit one fence: it `capture`s each run's fence from its lease.json when that
run's attempt joins, and holds it over that run's writes with `scoped`, so an attempt whose run was taken over
(killed and resumed) cannot land a step in the resumed run directory.

What is left: the window between the check and the rename it guards (microseconds on a local disk, one GET
before the PUT on an object store). The holder stops itself before a taker can take over (runtime/lease.py),
which closes that window unless a process stalls inside it for longer than the lease's TTL.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import fsspec

from storage.runstate import LEASE_FILE, Lease, LeaseLost, read_lease

FENCE_ENV = "ROLLFLOW_FENCE"


@dataclass
class Fence:
    root: str  # the run directory as its filesystem names it (no protocol, no trailing slash)
    owner: str
    generation: int
    lost: threading.Event = field(default_factory=threading.Event)  # set by the flow's lease keeper
    deadline: float | None = None  # monotonic time the holder's lease is good until (the flow's process only)
    why: str = ""

    def covers(self, path: str) -> bool:
        return (path == self.root or path.startswith(self.root + "/")) and path != f"{self.root}/{LEASE_FILE}"

    def token(self) -> str:
        return json.dumps({"root": self.root, "owner": self.owner, "generation": self.generation})


_installed: Fence | None = None
_from_env: tuple[str, Fence | None] = ("", None)
_scoped: Fence | None = None  # `scoped`: a run's fence held over some writes, in this process only


def install(root: str, lease: Lease) -> Fence:
    """Fence this process (and, through the environment, the processes it starts) with `lease` on `root`."""
    global _installed
    _installed = Fence(root.rstrip("/"), lease.owner, lease.generation)
    os.environ[FENCE_ENV] = _installed.token()
    return _installed


def uninstall(fence: Fence) -> None:
    global _installed
    if _installed is fence:
        _installed = None
        os.environ.pop(FENCE_ENV, None)


def active() -> Fence | None:
    """This process's fence: the one installed here, else the one its parent flow exported (parsed once)."""
    global _from_env
    if _installed is not None:
        return _installed
    raw = os.environ.get(FENCE_ENV, "")
    if raw != _from_env[0]:
        token = json.loads(raw) if raw else None
        _from_env = (raw, Fence(token["root"], token["owner"], int(token["generation"])) if token else None)
    return _from_env[1]


def capture(fs: fsspec.AbstractFileSystem, root: str) -> Fence | None:
    """The fence of the lease `root`'s lease.json names now (its holder's writes pass); None: no lease."""
    lease = read_lease(fs, root.rstrip("/"))
    return Fence(root.rstrip("/"), lease.owner, lease.generation) if lease is not None else None


@contextmanager
def scoped(fence: Fence | None) -> Iterator[None]:
    """Check every write under `fence.root` against `fence` for the block (this process only, not exported);
    writes elsewhere keep this process's own fence."""
    global _scoped
    previous, _scoped = _scoped, fence
    try:
        yield
    finally:
        _scoped = previous


def generation_for(root: str) -> int | None:
    f = active()
    return f.generation if f is not None and f.root == root.rstrip("/") else None


def check(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Raise `LeaseLost` if `path` is under a fenced run directory whose lease this process no longer holds."""
    f = _scoped if _scoped is not None and _scoped.covers(path) else active()
    if f is None or not f.covers(path):
        return
    if f.lost.is_set():
        raise LeaseLost(f"not writing {path}: the lease on {f.root} was lost ({f.why})")
    if f.deadline is not None and time.monotonic() > f.deadline:
        raise LeaseLost(f"not writing {path}: the lease on {f.root} was not renewed within its TTL")
    lease = read_lease(fs, f.root)
    if lease is None or (lease.owner, lease.generation) != (f.owner, f.generation):
        now = "no one" if lease is None else f"generation {lease.generation} (pid {lease.pid} on {lease.host})"
        f.why = f"lease.json names {now}"
        f.lost.set()  # for good: the flow's keeper stops the attempt at its next renewal
        raise LeaseLost(
            f"not writing {path}: the lease on {f.root} is held by {now}, not by this run's generation "
            f"{f.generation}; another flow took the run over, so this one must stop"
        )
