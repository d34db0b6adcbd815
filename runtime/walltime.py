"""Slurm's walltime warning, as the `rl` flow sees it.

The batch script asks Slurm for USR1 before the time limit (`--signal=B:USR1@N`); its shell turns the
signal into a file named by $ROLLFLOW_WALLTIME_FILE, inside a directory the job made for itself with
`mktemp -d`, and exports $ROLLFLOW_WALLTIME_GRACE_S (N/2) (launch/slurm.py). A thread here polls for that
file. It counts only if the directory is this user's and no one else's (mode 0700 or stricter) and the file
is a regular file of this user's: on a shared node another user must not be able to stop the run by
planting a file. When it appears:
  1. `checkpoint_request` is set: the flow relays SIGUSR1 to the trainer, which writes a checkpoint
     after its current step;
  2. it waits for that checkpoint, at most the grace period;
  3. `reached` is set and every attached `stop` event: the components stop as in any shutdown, the flow
     closes the run as unfinished and releases its lease, and `resume-unfinished` continues it later.
Outside Slurm (no variable) nothing is watched.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable

from launch.slurm import WALLTIME_FILE_ENV, WALLTIME_GRACE_ENV
from storage.fs import not_private


class WalltimeReached(RuntimeError):
    """The Slurm job's time limit is near: the run was stopped cleanly and can be resumed."""


class WalltimeWatch:
    def __init__(self, logger, checkpoints: Callable[[], list[int]], poll_s: float = 1.0) -> None:
        self.path = os.environ.get(WALLTIME_FILE_ENV)
        self.grace_s = float(os.environ.get(WALLTIME_GRACE_ENV) or 0)
        self.checkpoint_request = threading.Event()
        self.trainer_running = threading.Event()  # set by the flow while an RL trainer runs to checkpoint
        self.reached = threading.Event()
        self._checkpoints = checkpoints
        self._stops: list[threading.Event] = []
        self._done = threading.Event()
        self._logger = logger
        self._poll_s = poll_s
        self._thread: threading.Thread | None = None
        self._ignored = False  # a flag that is not ours was reported once

    def attach(self, stop: threading.Event) -> None:
        """Set `stop` when the warning comes (at once if it already came)."""
        self._stops.append(stop)
        if self.reached.is_set():
            stop.set()

    def _wait_for_checkpoint(self) -> None:
        before = max(self._checkpoints(), default=-1)
        self.checkpoint_request.set()
        self._logger.warning(f"Slurm's walltime warning: asking the trainer for a checkpoint (<= {self.grace_s:.0f}s)")
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self._done.wait(self._poll_s):
            newest = max(self._checkpoints(), default=-1)
            if newest > before:
                self._logger.info(f"checkpoint step={newest} written before the time limit")
                return
        self._logger.warning("no new checkpoint within the grace period; the last complete one is kept")

    def _flag_is_ours(self) -> bool:
        """The flag exists, is a regular file of this user's, in a directory only this user can enter."""
        assert self.path is not None
        try:
            flag = os.lstat(self.path)
            problem = not_private(os.path.dirname(self.path) or ".")
        except FileNotFoundError:
            return False
        uid = os.geteuid()
        if problem is None and stat.S_ISREG(flag.st_mode) and flag.st_uid == uid:
            return True
        if not self._ignored:
            self._ignored = True
            self._logger.warning(
                f"ignoring {self.path}: the walltime flag counts only as a file of uid {uid} in a directory of "
                f"that uid with mode 0700 (file uid {flag.st_uid}; directory: {problem or 'private'})"
            )
        return False

    def _watch(self) -> None:
        assert self.path is not None
        while not self._done.wait(self._poll_s):
            if self._flag_is_ours():
                if self.grace_s > 0 and self.trainer_running.is_set():
                    self._wait_for_checkpoint()
                self._logger.warning("stopping the components; the run stays resumable")
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
