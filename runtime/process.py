"""Run one component as a supervised subprocess: stream its output, stop its whole process group.

The process gets its own session so SIGTERM (then SIGKILL after a grace period) reaches every child.
Its output goes line by line to the caller's logger and to `OUTPUT_DIR/logs/<name>.log`, except its heartbeat
lines (config/stall.py), which go to the attempt's `StallWatch` (runtime/stall.py); the supervising loop asks
the watch about the component every STALL_POLL_S and stops it as `ComponentStalled` when it is stuck.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from config.stall import split_beat
from runtime.stall import StallWatch

STALL_POLL_S = 0.5
WATCH_S = 0.25  # how soon the supervisor sees its process exit (`stop` wakes it at once)
# glibc gives each thread that allocates an arena of its own (up to 8 per core) and reuses freed memory only in the
# same arena; a component's threads (heartbeat, MLflow, pyarrow, the HTTP server) each keep theirs. Two arenas cut
# about 30 MB of a tiny-cpu run's peak at the same step time (docs/benchmarks.md); the caller's setting wins.
MALLOC_ARENAS = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}


class ComponentFailed(RuntimeError):
    """A component exited non-zero on its own; the message carries its last output lines."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode  # the component's exit code; None when it did not exit (stopped, refused)

    def __reduce__(self):  # keeps the exit code through pickling (Prefect may serialize a task's error)
        return type(self), (str(self), self.returncode)


class ComponentStalled(ComponentFailed):
    """A live component made no progress for its stall timeout (runtime/stall.py); the flow stopped it."""


def _pump(proc: subprocess.Popen, emit: Callable[[str], None], log_file, tail: collections.deque, beats=None) -> None:
    """Drain the child's output to the end whatever happens downstream: an undrained pipe blocks the child.
    `beats(beat)` takes its heartbeat lines, which are not logged (the text before one in the line is)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line, beat = split_beat(raw.rstrip("\n"))
        if beat is not None and beats is not None:
            beats(beat)
        if beat is not None and not line:
            continue
        tail.append(line)
        try:
            emit(line)
            if log_file:
                log_file.write(line + "\n")
                log_file.flush()
        except Exception:  # noqa: S110 - a logging hiccup must not stop the drain
            pass


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux/glibc: the supervisor's own cleanup still applies


# Resolved once in the parent: the child between fork and exec must not load libraries (lock hazards).
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervising thread dies, even by SIGKILL."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when no member is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def terminate_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the whole process group, give it `grace_s` to exit, then SIGKILL what is left.

    The leader exiting is not enough: a child that ignores SIGTERM would outlive it.
    """
    pgid = proc.pid  # start_new_session=True makes the child its group's leader
    _signal_group(pgid, signal.SIGTERM)
    _signal_group(pgid, signal.SIGCONT)  # a stopped member acts on SIGTERM only once it runs again
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or _signal_group(pgid, 0)):
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()


def _watch(proc: subprocess.Popen, stop: threading.Event, nudge: threading.Event | None, stuck) -> str | None:
    """Until the process exits or `stop` is set; returns why it is stuck when `stuck()` says so first."""
    nudged, next_check = False, time.monotonic() + STALL_POLL_S
    while proc.poll() is None and not stop.is_set():
        if nudge is not None and nudge.is_set() and not nudged:
            _signal_group(proc.pid, signal.SIGUSR1)
            nudged = True
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + STALL_POLL_S
            if (why := stuck()) is not None:
                return why
        stop.wait(WATCH_S)
    return None


def supervise(
    name: str,
    argv: list[str],
    env: dict[str, str],
    emit: Callable[[str], None],
    stop: threading.Event,
    log_path: str | None = None,
    grace_s: float = 10.0,
    nudge: threading.Event | None = None,
    stall: StallWatch | None = None,
) -> int:
    """Run `argv` until it exits or `stop` is set. Raises ComponentFailed on a non-zero exit of its own.
    When `nudge` is set, the process group gets SIGUSR1 once (srun forwards it to the step's tasks).
    `stall`: the attempt's watch; the component stuck by its rules is stopped and ComponentStalled raised."""
    log_file = None
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "a")  # noqa: SIM115 - closed in finally
    tail: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only a preloaded C call runs in the child
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1", **MALLOC_ARENAS},
        start_new_session=True,
    )
    if stall is not None:
        stall.launched(name)
    beats = (lambda beat: stall.beat(name, beat)) if stall is not None else None
    reader = threading.Thread(target=_pump, args=(proc, emit, log_file, tail, beats), daemon=True)
    reader.start()
    stuck = None
    try:
        stuck = _watch(proc, stop, nudge, lambda: stall.verdict(name) if stall is not None else None)
    finally:
        terminate_group(proc, grace_s)
        reader.join(timeout=5)
        if stall is not None:
            stall.finished(name)
        if log_file:
            log_file.close()
    if stuck is not None:
        emit(stuck)
        raise ComponentStalled(stuck, proc.returncode)
    if proc.returncode != 0 and stop.is_set():
        emit(f"exited with code {proc.returncode} after being asked to stop")
    elif proc.returncode != 0:
        tail_text = "\n".join(tail)
        raise ComponentFailed(f"{name} exited with code {proc.returncode}; last output:\n{tail_text}", proc.returncode)
    return proc.returncode
