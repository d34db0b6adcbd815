"""runtime/process.py supervising real (tiny) subprocesses."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.process import ComponentFailed, supervise
from storage.runstate import pid_alive


def test_failure_raises_with_the_last_output_lines(tmp_path):
    lines: list[str] = []
    argv = ["bash", "-c", "echo first; echo boom >&2; exit 3"]
    with pytest.raises(ComponentFailed) as err:
        supervise("demo", argv, {}, lines.append, threading.Event(), str(tmp_path / "demo.log"))
    assert "exited with code 3" in str(err.value) and "boom" in str(err.value)
    assert lines == ["first", "boom"]
    assert (tmp_path / "demo.log").read_text() == "first\nboom\n"


def test_clean_exit_returns_zero_and_passes_env():
    lines: list[str] = []
    rc = supervise("demo", ["bash", "-c", "echo $DEMO_VAR"], {"DEMO_VAR": "hello"}, lines.append, threading.Event())
    assert rc == 0 and lines == ["hello"]


def test_stop_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The grandchild ignores SIGTERM, so only the SIGKILL after the grace period stops it.
    argv = ["bash", "-c", f"(trap '' TERM; sleep 60) & echo $! > {pidfile}; wait"]
    stop = threading.Event()

    def stop_once_the_grandchild_runs() -> None:  # a loaded machine may take seconds to start bash
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped_at.append(time.monotonic())
        stop.set()

    stopped_at: list[float] = []
    threading.Thread(target=stop_once_the_grandchild_runs, daemon=True).start()
    rc = supervise("demo", argv, {}, lambda _: None, stop, grace_s=0.5)
    assert rc != 0 and time.monotonic() - stopped_at[0] < 10
    deadline = time.monotonic() + 5
    child = int(pidfile.read_text())
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)
