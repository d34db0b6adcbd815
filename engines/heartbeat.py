"""A component's progress, printed for the flow that supervises it (config/stall.py: the line and its rules).

The component's main loop calls `advance()` each time it moves (a trainer micro-batch, an orchestrator group,
a request a server answers) and brackets a wait on another component with `waiting_on(name)`; a server
counts what it holds with `hold()` and is idle (never stuck) while it holds nothing. A reporter prints the
state every $ROLLFLOW_HEARTBEAT_S seconds: from a daemon thread (`start_thread`: the trainer, whose counter
proves its loop moves), or from a task on the process's event loop (`run`: the async processes, where a
blocked loop stops the lines as a stopped process does). Without the variable (a process started by hand)
nothing is printed and the calls only count.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator

from config.stall import HEARTBEAT_ENV, IDLE, Beat, format_beat


class Heartbeat:
    def __init__(self, interval_s: float | None, rank: int = 0, fd: int = 1):
        self.interval_s, self.rank, self.fd = interval_s, rank, fd
        self.progress, self.doing = 0, "starting"
        self.server = False  # a server: idle while it holds nothing
        self.held = 0
        self._waits: dict[int, tuple[int, str]] = {}  # token -> (priority, component waited on)
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def advance(self, doing: str | None = None) -> None:
        """The main loop moved; `doing` says, in words, what it does next."""
        self.progress += 1
        if doing is not None:
            self.doing = doing

    @contextlib.contextmanager
    def waiting_on(self, component: str, doing: str | None = None, priority: int = 0) -> Iterator[None]:
        """Inside: this component waits on `component`, which the flow judges instead. With several waits open
        at once (concurrent tasks) the one of highest `priority`, then the newest, is reported: a request in
        flight that the other waits depend on outranks them (the orchestrator's weight push)."""
        token = next(self._tokens)
        self._waits[token] = (priority, component)
        if doing is not None:
            self.doing = doing
        try:
            yield
        finally:
            self._waits.pop(token, None)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """A server holds one piece of work (a request, a weight update) inside; finishing it is progress."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self.advance()

    def beat(self) -> Beat:
        waits = sorted(self._waits.items(), key=lambda item: (item[1][0], item[0]))
        waiting = waits[-1][1][1] if waits else (IDLE if self.server and self.held == 0 else "")
        doing = f"{self.held} held" if self.server else self.doing
        return Beat(self.progress, waiting, self.rank, doing)

    def emit(self) -> None:
        with contextlib.suppress(OSError):  # the flow went away: nothing to tell
            os.write(self.fd, format_beat(self.beat()))

    def start_thread(self) -> None:
        """Report from a daemon thread (a no-op without an interval, or when already reporting)."""
        if self.interval_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat_forever(self) -> None:
        assert self.interval_s is not None
        stop = threading.Event()
        while not stop.wait(self.interval_s):
            self.emit()

    async def run(self) -> None:
        """Report from the running event loop until cancelled (returns at once without an interval)."""
        if self.interval_s is None:
            return
        while True:
            self.emit()
            await asyncio.sleep(self.interval_s)


_CURRENT: Heartbeat | None = None


def heartbeat() -> Heartbeat:
    """This process's heartbeat, from the flow's environment (its interval; torchrun's RANK)."""
    global _CURRENT
    if _CURRENT is None:
        interval = float(os.environ.get(HEARTBEAT_ENV) or 0) or None
        _CURRENT = Heartbeat(interval, int(os.environ.get("RANK", "0")))
    return _CURRENT
