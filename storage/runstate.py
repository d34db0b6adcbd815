"""A run's lifecycle record (`OUTPUT_DIR/state.json`) and its lease (`OUTPUT_DIR/lease.json`).

The state says whether a run finished and which MLflow run its metrics go to, so a resume continues
the same MLflow run. The lease says who is running it: the flow that holds it renews it every
ttl/3 seconds; a lease that is past its expiry, or whose holder is a dead process on this host, is free.
Two resumptions can therefore never run one run at once: the second finds a live lease and is refused.

Acquiring is write-then-read-back: on an object store without conditional writes two writers can
race, and the read-back (after a short settle) makes the loser see the winner's lease and back off.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from storage.fs import join, write_json

STATE_FILE = "state.json"
LEASE_FILE = "lease.json"


class LeaseHeld(RuntimeError):
    """Another live process holds the run's lease."""


@dataclass
class RunState:
    run_id: str
    mlflow_run_id: str | None  # metrics of every attempt land in this one MLflow run
    status: str = "running"  # running | finished | failed: what the scheduled resumption looks at
    attempts: int = 0  # component launches so far, restarts and resumes included
    resumes: list[dict[str, Any]] = field(default_factory=list)  # when, from which checkpoint, config changes


def read_state(fs: fsspec.AbstractFileSystem, root: str) -> RunState | None:
    path = join(root, STATE_FILE)
    fs.invalidate_cache(root)
    if not fs.exists(path):
        return None
    return RunState(**json.loads(fs.cat_file(path)))


def write_state(fs: fsspec.AbstractFileSystem, root: str, state: RunState) -> None:
    write_json(fs, join(root, STATE_FILE), asdict(state))


@dataclass
class Lease:
    owner: str  # random per acquisition: tells our lease from a later holder's
    host: str
    pid: int
    expires_at: float  # unix time; renewed every ttl/3 by the holder


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process on this host (a zombie counts as dead: PID 1 here may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
    except OSError:
        return True


def read_lease(fs: fsspec.AbstractFileSystem, root: str) -> Lease | None:
    path = join(root, LEASE_FILE)
    fs.invalidate_cache(root)
    try:
        return Lease(**json.loads(fs.cat_file(path)))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, TypeError):
        return None  # a torn or foreign lease file protects nothing


def is_live(lease: Lease | None, now: float | None = None) -> bool:
    if lease is None or lease.expires_at <= (now or time.time()):
        return False
    if lease.host == socket.gethostname():
        return pid_alive(lease.pid)
    return True


def describe(lease: Lease) -> str:
    left = max(0.0, lease.expires_at - time.time())
    return f"held by pid {lease.pid} on {lease.host}, valid for another {left:.0f}s unless renewed"


def acquire(fs: fsspec.AbstractFileSystem, root: str, ttl_s: float, settle_s: float = 0.2) -> Lease:
    current = read_lease(fs, root)
    if is_live(current):
        assert current is not None
        raise LeaseHeld(f"{root} is already being run ({describe(current)})")
    lease = Lease(uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time() + ttl_s)
    fs.makedirs(root, exist_ok=True)
    write_json(fs, join(root, LEASE_FILE), asdict(lease))
    time.sleep(settle_s)
    winner = read_lease(fs, root)
    if winner is None or winner.owner != lease.owner:
        raise LeaseHeld(f"{root}: another process took the lease at the same moment; it runs the run")
    return lease


def renew(fs: fsspec.AbstractFileSystem, root: str, lease: Lease, ttl_s: float) -> bool:
    """Extend our lease; False (and nothing written) when someone else holds it now."""
    current = read_lease(fs, root)
    if current is not None and current.owner != lease.owner:
        return False
    lease.expires_at = time.time() + ttl_s
    write_json(fs, join(root, LEASE_FILE), asdict(lease))
    return True


def release(fs: fsspec.AbstractFileSystem, root: str, lease: Lease) -> None:
    current = read_lease(fs, root)
    if current is not None and current.owner == lease.owner:
        fs.rm(join(root, LEASE_FILE))


def find_resumable(parent_url: str) -> list[str]:
    """Run directories under `parent_url` that are unfinished and not running (no live lease)."""
    from storage.fs import get_fs

    fs, parent = get_fs(parent_url)
    if not fs.exists(parent):
        return []
    found = []
    for entry in sorted(fs.ls(parent, detail=False)):
        state = read_state(fs, entry) if fs.exists(join(entry, "config", "run.json")) else None
        if state is not None and state.status != "finished" and not is_live(read_lease(fs, entry)):
            found.append(entry if "://" not in parent_url else f"{parent_url.split('://')[0]}://{entry}")
    return found
