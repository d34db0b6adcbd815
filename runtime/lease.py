"""Hold a run's lease for as long as the flow runs it, and stop the run the moment it is lost.

Acquired on entry (storage/runstate.py `acquire`: may watch another host's lease for its TTL first), renewed
by a daemon thread every ttl/4, released on exit. While held, this process and every process it starts are
fenced (storage/fence.py): each commit under the run directory checks that the lease still names this
generation. The lease counts as lost when a renewal finds another owner (or none), or when no renewal has
succeeded for 0.9 x TTL, measured from the start of the last good one on this host's monotonic clock. A taker
on another host waits a whole TTL from after that renewal landed, so the holder has given up before anyone
can take over, whatever the two hosts' wall clocks say. On loss every attached `stop` event is set (the
attempt's components are stopped), the fence refuses further commits, and `raise_if_lost` ends the flow.
A process killed outright stops renewing, so its lease is taken over (at once on the same host: dead pid).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec

from storage import fence, runstate

GIVE_UP = 0.9  # of the TTL without a good renewal: the holder stops before a taker's TTL-long watch ends
RENEWALS_PER_TTL = 4  # renewal attempts per TTL: three may fail before the holder gives up


class LeaseKeeper:
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, ttl_s: float, logger) -> None:
        self.fs, self.root, self.ttl_s, self.logger = fs, root, ttl_s, logger
        self.lease = runstate.acquire(fs, root, ttl_s, log=logger.info)
        self.fence = fence.install(root, self.lease)
        self.fence.deadline = time.monotonic() + GIVE_UP * ttl_s
        self._stops: list[threading.Event] = []
        self._done = threading.Event()

    @property
    def lost(self) -> bool:
        return self.fence.lost.is_set()

    def attach(self, stop: threading.Event) -> None:
        """Set `stop` when the lease is lost (at once if it already is)."""
        self._stops.append(stop)
        if self.lost:
            stop.set()

    def raise_if_lost(self) -> None:
        if self.lost:
            raise runstate.LeaseLost(f"stopped: the lease on {self.root} was lost ({self.fence.why})")

    def _lose(self, why: str) -> None:
        self.fence.why = why
        self.fence.lost.set()
        self.logger.error(f"lost the lease on {self.root}: {why}; stopping this attempt, committing nothing more")
        for stop in self._stops:
            stop.set()

    def _renew_once(self) -> bool:
        """One renewal; False once the lease is lost (taken, released by someone, or overdue)."""
        started = time.monotonic()
        try:
            if not runstate.renew(self.fs, self.root, self.lease, self.ttl_s):
                self._lose("another process holds it now (or removed it)")
                return False
            self.fence.deadline = started + GIVE_UP * self.ttl_s
        except OSError as exc:  # a storage hiccup: try again next period, while the deadline allows
            self.logger.warning(f"could not renew the lease on {self.root}: {exc}")
        if time.monotonic() > (self.fence.deadline or 0):
            self._lose(f"not renewed for {GIVE_UP * self.ttl_s:.1f}s (lease TTL {self.ttl_s}s)")
            return False
        return True

    def run(self) -> None:
        while not self._done.wait(self.ttl_s / RENEWALS_PER_TTL) and self._renew_once():
            pass

    def close(self) -> None:
        self._done.set()
        fence.uninstall(self.fence)
        if not self.lost:
            runstate.release(self.fs, self.root, self.lease)


@contextmanager
def hold_lease(fs: fsspec.AbstractFileSystem, root: str, ttl_s: float, logger) -> Iterator[LeaseKeeper]:
    keeper = LeaseKeeper(fs, root, ttl_s, logger)
    renewer = threading.Thread(target=keeper.run, name="lease", daemon=True)
    renewer.start()
    try:
        yield keeper
    finally:
        keeper.close()
        renewer.join(timeout=5)
