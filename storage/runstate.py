"""A run's lifecycle record (`OUTPUT_DIR/state.json`) and its lease (`OUTPUT_DIR/lease.json`).

The state says whether a run finished (or was cancelled) and which MLflow run its metrics go to, so a resume
continues the same MLflow run. The lease says who is running it: the flow that holds it renews it every
ttl/4 seconds, each renewal counting up `renewals`. Every acquisition gets a new `generation` (one more
than any before it, kept across releases through `state.json`), the fencing token storage/fence.py checks
before every commit.

Taking a lease over never compares wall clocks across hosts. A lease on this host is free when its process
is dead or, on this host's one clock, it expired. Any other lease is free only once the taker has watched
it go unrenewed (same owner, same renewal count) for the holder's whole TTL, timed by the taker's own
monotonic clock; a holder that cannot renew stops itself before that (runtime/lease.py). Clock offsets
between hosts therefore cannot hand a live lease to a second flow; they only shift `is_live`, the cheap
hint the CLI and the scheduled resumption use to skip runs that look busy.

Acquiring is write-then-read-back: on an object store without conditional writes two writers can
race, and the read-back (after a short settle) makes the loser see the winner's lease and back off.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from storage.fs import join, write_json

STATE_FILE = "state.json"
LEASE_FILE = "lease.json"
# state.json statuses; the scheduled resumption resumes only these (a cancelled run waits for a person)
RESUMABLE = ("running", "failed")


class LeaseHeld(RuntimeError):
    """Another live process holds the run's lease."""


class LeaseLost(RuntimeError):
    """This process no longer holds the run's lease: it must stop and commit nothing more."""


@dataclass
class RunState:
    run_id: str
    mlflow_run_id: str | None  # metrics of every attempt land in this one MLflow run
    status: str = "running"  # running | finished | failed | cancelled: what the scheduled resumption looks at
    attempts: int = 0  # component launches so far, restarts and resumes included
    resumes: list[dict[str, Any]] = field(default_factory=list)  # when, from which checkpoint, config changes
    lease_generation: int = 0  # the lease generation of the flow that wrote this state last


def read_state(fs: fsspec.AbstractFileSystem, root: str) -> RunState | None:
    path = join(root, STATE_FILE)
    fs.invalidate_cache(root)
    if not fs.exists(path):
        return None
    return RunState(**json.loads(fs.cat_file(path)))


def write_state(fs: fsspec.AbstractFileSystem, root: str, state: RunState) -> None:
    """Write state.json (fenced like every commit), stamped with the writer's lease generation."""
    from storage import fence  # fence reads leases from here

    state.lease_generation = fence.generation_for(root) or state.lease_generation
    write_json(fs, join(root, STATE_FILE), asdict(state))


@dataclass
class Lease:
    owner: str  # random per acquisition: tells our lease from a later holder's
    host: str
    pid: int
    expires_at: float  # unix time on the holder's clock; compared only on the holder's own host
    generation: int = 0  # the fencing token: one more than every earlier holder's
    renewals: int = 0  # counts up at each renewal: what a taker on another host watches
    ttl_s: float = 0.0  # the holder's TTL: how long a taker watches before it takes over


def this_host() -> str:
    return socket.gethostname()


def wall_clock() -> float:
    """Unix time; a function so a test can give this process a skewed clock."""
    return time.time()


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
    """A hint (no waiting): whether `lease` looks held. On this host it is exact; for another host's lease it
    compares that host's clock with ours, so skew can make a dead lease look live for as long as the skew.
    `acquire` decides takeovers without wall clocks."""
    if lease is None or lease.expires_at <= (now or wall_clock()):
        return False
    if lease.host == this_host():
        return pid_alive(lease.pid)
    return True


def describe(lease: Lease) -> str:
    left = max(0.0, lease.expires_at - wall_clock())
    return (
        f"held by pid {lease.pid} on {lease.host} (generation {lease.generation}), "
        f"valid for another {left:.0f}s unless renewed by its clock"
    )


def _same_holding(a: Lease, b: Lease) -> bool:
    return (a.owner, a.generation, a.renewals) == (b.owner, b.generation, b.renewals)


def _wait_unrenewed(fs, root: str, seen: Lease, ttl_s: float, log: Callable[[str], None]) -> None:
    """Return once `seen` has gone unrenewed for its holder's TTL by our monotonic clock (or was released);
    LeaseHeld as soon as it is renewed or taken by someone else."""
    window = seen.ttl_s or ttl_s
    log(f"{root}: lease {describe(seen)}; taking it over if it goes unrenewed for {window:.1f}s")
    poll = max(0.05, min(1.0, window / 20))
    deadline = time.monotonic() + window
    while time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        now = read_lease(fs, root)
        if now is None:
            return  # released while we watched
        if not _same_holding(now, seen):
            raise LeaseHeld(f"{root} is being run: its lease was renewed while we watched ({describe(now)})")


def _verdict(lease: Lease) -> str:
    """What to do about someone's lease: `take` (its process on this host is dead), `held` (live process on this
    host, unexpired on this host's one clock), else `watch` (another host's, or a live process whose lease
    expired: hung, or this host's clock stepped)."""
    if lease.host == this_host() and not pid_alive(lease.pid):
        return "take"
    if lease.host == this_host() and lease.expires_at > wall_clock():
        return "held"
    return "watch"


def _next_generation(fs, root: str, current: Lease | None) -> int:
    state = read_state(fs, root) if fs.exists(join(root, STATE_FILE)) else None
    return max(current.generation if current else 0, state.lease_generation if state else 0) + 1


def acquire(
    fs: fsspec.AbstractFileSystem,
    root: str,
    ttl_s: float,
    settle_s: float = 0.2,
    log: Callable[[str], None] = lambda _: None,
) -> Lease:
    """Take the run's lease with the next generation, or raise LeaseHeld (see the module docstring for when)."""
    current = read_lease(fs, root)
    verdict = "take" if current is None else _verdict(current)
    if current is not None and verdict == "held":
        raise LeaseHeld(f"{root} is already being run ({describe(current)})")
    if current is not None and verdict == "watch":
        _wait_unrenewed(fs, root, current, ttl_s, log)
    fs.makedirs(root, exist_ok=True)
    lease = Lease(uuid.uuid4().hex, this_host(), os.getpid(), wall_clock() + ttl_s, 0, 0, ttl_s)
    lease.generation = _next_generation(fs, root, current)
    write_json(fs, join(root, LEASE_FILE), asdict(lease))
    time.sleep(settle_s)
    winner = read_lease(fs, root)
    if winner is None or winner.owner != lease.owner:
        raise LeaseHeld(f"{root}: another process took the lease at the same moment; it runs the run")
    return lease


def renew(fs: fsspec.AbstractFileSystem, root: str, lease: Lease, ttl_s: float) -> bool:
    """Extend our lease; False (and nothing written) when someone else holds it now, or no one does."""
    current = read_lease(fs, root)
    if current is None or current.owner != lease.owner:
        return False
    lease.expires_at = wall_clock() + ttl_s
    lease.renewals += 1
    write_json(fs, join(root, LEASE_FILE), asdict(lease))
    return True


def release(fs: fsspec.AbstractFileSystem, root: str, lease: Lease) -> None:
    current = read_lease(fs, root)
    if current is not None and current.owner == lease.owner:
        fs.rm(join(root, LEASE_FILE))


def find_resumable(parent_url: str) -> list[str]:
    """Run directories under `parent_url` that are unfinished, not cancelled and not running (no live lease)."""
    from storage.fs import get_fs

    fs, parent = get_fs(parent_url)
    if not fs.exists(parent):
        return []
    found = []
    for entry in sorted(fs.ls(parent, detail=False)):
        state = read_state(fs, entry) if fs.exists(join(entry, "config", "run.json")) else None
        if state is not None and state.status in RESUMABLE and not is_live(read_lease(fs, entry)):
            found.append(entry if "://" not in parent_url else f"{parent_url.split('://')[0]}://{entry}")
    return found
