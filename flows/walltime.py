"""Slurm's walltime warning, as the `rl` flow sees it.

The batch script asks Slurm for USR1 before the time limit (`--signal=B:USR1@N`); its shell turns the
signal into a file named by $ROLLFLOW_WALLTIME_FILE (tasks/slurm.py). A thread here polls for that file
and, when it appears, sets every attached `stop` event: the components stop as in any shutdown, the
flow closes the run as unfinished and releases its lease, and `resume-unfinished` continues it later
from its last complete checkpoint. Outside Slurm (no variable) nothing is watched.
"""

from __future__ import annotations

import os
import threading

from tasks.slurm import WALLTIME_FILE_ENV


class WalltimeReached(RuntimeError):
    """The Slurm job's time limit is near: the run was stopped cleanly and can be resumed."""


class WalltimeWatch:
    def __init__(self, logger, poll_s: float = 1.0, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get(WALLTIME_FILE_ENV)
        self.reached = threading.Event()
        self._stops: list[threading.Event] = []
        self._done = threading.Event()
        self._logger = logger
        self._poll_s = poll_s
        self._thread: threading.Thread | None = None

    def attach(self, stop: threading.Event) -> None:
        """Set `stop` when the warning comes (at once if it already came)."""
        self._stops.append(stop)
        if self.reached.is_set():
            stop.set()

    def _watch(self) -> None:
        assert self.path is not None
        while not self._done.wait(self._poll_s):
            if os.path.exists(self.path):
                self._logger.warning("Slurm's walltime warning arrived: stopping the components to resume later")
                self.reached.set()
                for stop in self._stops:
                    stop.set()
                return

    def __enter__(self) -> WalltimeWatch:
        if self.path:
            self._thread = threading.Thread(target=self._watch, name="walltime", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
