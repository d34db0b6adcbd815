"""Which live component of an attempt is stuck: the flow's judge of the heartbeats (config/stall.py).

    component output --(runtime/process.py drains it)--> heartbeat lines --> StallWatch.beat(component, Beat)
    each supervising thread, every poll --> StallWatch.verdict(component) --> None, or why it is stuck

Every time is the flow's own monotonic clock when a line arrives. Per component and rank the watch keeps when
its counter last moved and the slowest stretch of work between two moves (which sets its timeout: the larger
of the component's floor and `pace_factor` x that stretch; `startup_s` until the first move). The rules:
  - no heartbeat for the timeout (since launch before the first one): stuck, the process is stopped or blocked;
  - working (not waiting, not idle) and no move for the timeout: stuck;
  - waiting on another component: follow what each waits on; ending at one that works, that one is judged
    instead; ending at an idle server, an unknown or finished component, or going round in a circle (two
    components waiting on each other): stuck once no component on the way has moved for the timeout;
  - idle (a server holding nothing): never stuck on progress.
The verdict names the component and rank, its last progress and what it was doing, for how long, the timeout,
and the state of every other component, so the log says what was stuck and what waited on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from config.stall import IDLE, Beat, StallConfig


@dataclass
class Track:
    """What the watch knows of one component's rank."""

    launched: float
    beat: Beat | None = None
    last_beat: float | None = None
    moved: float | None = None  # when its counter last moved (None: not since launch)
    active_from: float = 0.0  # start of its current stretch of work: its last move, or the end of its last wait
    slowest: float = 0.0  # the slowest stretch of work between two moves seen in this attempt
    history: list[str] = field(default_factory=list)


class StallWatch:
    """Thread-safe: pumps feed it, supervising threads ask it."""

    def __init__(self, cfg: StallConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._tracks: dict[tuple[str, int], Track] = {}
        self._finished: set[str] = set()
        self._lock = threading.Lock()

    def launched(self, component: str) -> None:
        """The component's process was (re)started now: its startup timeout runs from here."""
        with self._lock:
            now = self.clock()
            self._finished.discard(component)
            for key in [k for k in self._tracks if k[0] == component]:
                del self._tracks[key]
            self._tracks[(component, 0)] = Track(launched=now, active_from=now)

    def finished(self, component: str) -> None:
        """The component exited: it is judged no more, and those waiting on it count as waiting on nothing."""
        with self._lock:
            self._finished.add(component)

    def beat(self, component: str, beat: Beat) -> None:
        with self._lock:
            now = self.clock()
            key = (component, beat.rank)
            t = self._tracks.get(key) or self._tracks.setdefault(key, Track(launched=now, active_from=now))
            previous, t.beat, t.last_beat = t.beat, beat, now
            moved = previous is not None and beat.progress != previous.progress
            if moved and t.moved is not None:  # the stretch before the first move is loading, not pace
                t.slowest = max(t.slowest, now - t.active_from)
            if moved:
                t.moved = now
            if moved or beat.waiting:  # waiting or idle time is not work: the next stretch starts here
                t.active_from = now

    def timeout_s(self, component: str, rank: int = 0) -> float:
        with self._lock:
            return self._timeout(self._tracks.get((component, rank)), component)

    def _timeout(self, t: Track | None, component: str) -> float:
        if t is None or t.moved is None:
            return self.cfg.startup_s
        return max(self.cfg.floor_s(component), self.cfg.pace_factor * t.slowest)

    def verdict(self, component: str) -> str | None:
        """Why `component` is stuck now (with every component's state), or None while it is not."""
        if not self.cfg.enabled:
            return None
        with self._lock:
            now = self.clock()
            for (name, rank), t in sorted(self._tracks.items()):
                if name == component and (why := self._why(name, rank, t, now)):
                    return f"{self._label(name, rank)} is stuck: {why}; restarting the attempt\n" + self._states(now)
        return None

    def _why(self, name: str, rank: int, t: Track, now: float) -> str | None:
        limit = self._timeout(t, name)
        heard = t.last_beat if t.last_beat is not None else t.launched
        if now - heard > limit:
            what = "since it started" if t.last_beat is None else f"for {now - heard:.0f}s"
            return f"no heartbeat {what} (timeout {limit:.0f}s): the process is stopped or its loop is blocked"
        if t.beat is None or t.beat.waiting == IDLE:
            return None
        if not t.beat.waiting:
            if now - t.active_from <= limit:
                return None
            silent = (
                f"; no heartbeat for {now - heard:.0f}s either: it is stopped or blocked"
                if self._silent(t, now)
                else ""
            )
            return f"no progress for {now - t.active_from:.0f}s (timeout {limit:.0f}s){silent}"
        return self._why_waiting(name, t, now, limit)

    def _why_waiting(self, name: str, t: Track, now: float, limit: float) -> str | None:
        """Follow what each waits on; None when the chain ends at a component that works (that one is judged)."""
        chain, current = [name], t
        while current.beat is not None and current.beat.waiting not in ("", IDLE):
            target = current.beat.waiting
            nxt = None if target in self._finished else self._tracks.get((target, 0))
            if target in chain or nxt is None or nxt.beat is None:
                end = "a circle" if target in chain else "exited" if target in self._finished else "not reporting"
                chain.append(f"{target} ({end})")
                break
            chain.append(target)
            current = nxt
        else:
            if current.beat is not None and not current.beat.waiting:
                return None  # a working component at the end: it is judged on its own progress
            chain[-1] += " (idle)"
        tracks = [self._tracks.get((c.split(" ")[0], 0)) for c in chain]
        if any(x is not None and self._silent(x, now) for x in tracks[1:]):
            return None  # one it waits on is silent: that one is stuck, by its own rule, not this one
        last = max((x.moved or x.launched) for x in tracks if x is not None)
        if now - last <= limit:
            return None
        path = " -> ".join(chain)
        return f"waiting on {path}, none of which moved for {now - last:.0f}s (timeout {limit:.0f}s)"

    def _silent(self, t: Track, now: float) -> bool:
        """No heartbeat for two intervals: stopped or blocked (its own timeout then decides)."""
        heard = t.last_beat if t.last_beat is not None else t.launched
        return now - heard > 2 * self.cfg.heartbeat_s

    def _label(self, name: str, rank: int) -> str:
        return name if rank == 0 and (name, 1) not in self._tracks else f"{name} rank {rank}"

    def _states(self, now: float) -> str:
        lines = []
        for (name, rank), t in sorted(self._tracks.items()):
            b = t.beat
            state = (
                "no heartbeat yet"
                if b is None
                else (
                    f"progress {b.progress} ({b.doing or 'working'})"
                    + (
                        f", waiting on {b.waiting}"
                        if b.waiting and b.waiting != IDLE
                        else ", idle"
                        if b.waiting
                        else ""
                    )
                )
            )
            heard = "never" if t.last_beat is None else f"{now - t.last_beat:.0f}s ago"
            moved = "not since launch" if t.moved is None else f"{now - t.moved:.0f}s ago"
            gone = " (exited)" if name in self._finished else ""
            lines.append(f"  {self._label(name, rank)}{gone}: {state}; last heartbeat {heard}; last moved {moved}")
        return "\n".join(lines)
