"""Hold a run's lease for as long as the flow runs it: acquired on entry, renewed by a daemon thread
every ttl/3, released on exit. A process killed outright stops renewing, so its lease expires (or,
on the same host, is seen to belong to a dead pid) and a resumption can take the run over."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec

from storage import runstate


@contextmanager
def hold_lease(fs: fsspec.AbstractFileSystem, root: str, ttl_s: float, logger) -> Iterator[runstate.Lease]:
    lease = runstate.acquire(fs, root, ttl_s)
    done = threading.Event()

    def keep_renewing() -> None:
        while not done.wait(ttl_s / 3):
            try:
                if not runstate.renew(fs, root, lease, ttl_s):
                    logger.error(f"lost the lease on {root} to another process; it must not run this run twice")
                    return
            except OSError as exc:  # a storage hiccup: try again next period, before the lease runs out
                logger.warning(f"could not renew the lease on {root}: {exc}")

    renewer = threading.Thread(target=keep_renewing, name="lease", daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        done.set()
        renewer.join(timeout=5)
        runstate.release(fs, root, lease)
