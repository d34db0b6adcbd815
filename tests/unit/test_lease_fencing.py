"""Leases that fence, with real processes (tests/unit/lease_holder.py holds a lease and commits like a flow):
a second flow is refused while the first renews, whatever the clocks say; a stalled holder is taken over only
after its TTL on the taker's own clock, and its late commits are refused; a flow that loses its lease stops its
components, whose own commits the fence refuses too; a holder that cannot renew stops before a taker may come.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.lease import hold_lease
from storage import fence, runstate
from storage.fs import get_fs, join, write_json

HOLDER = Path(__file__).with_name("lease_holder.py")
TTL = 2.0


class Holder:
    """A lease_holder.py process and the lines it printed."""

    def __init__(self, mode: str, root: Path, host: str = "node-a"):
        argv = [sys.executable, str(HOLDER), mode, str(root), str(TTL), host]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n" + "\n".join(self.lines[-30:])
            assert self.proc.poll() is None or any(text in line for line in self.lines), "\n".join(self.lines)
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def other_host(monkeypatch):
    """This process as a taker on another host than the holder's (no pid shortcut), with a settable clock."""
    monkeypatch.setattr(runstate, "this_host", lambda: "node-b")

    def skew(offset_s: float) -> None:
        monkeypatch.setattr(runstate, "wall_clock", lambda: time.time() + offset_s)

    return skew


def _commits(root: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in (root / "commits").glob(f"{prefix}-*"))


def test_a_second_flow_is_refused_while_the_first_renews_and_takes_over_only_after_its_ttl(tmp_path, other_host):
    holder = Holder("flow", tmp_path)
    try:
        holder.wait_for("committed 0")
        fs, root = get_fs(str(tmp_path))
        # The same host (the holder's name, its live pid): a fresh lease refuses a second flow at once.
        other_host(0.0)
        with pytest.MonkeyPatch.context() as same:
            same.setattr(runstate, "this_host", lambda: "node-a")
            with pytest.raises(runstate.LeaseHeld, match="already being run"):
                runstate.acquire(fs, root, TTL, settle_s=0)
        # Another host whose clock is a TTL and a second ahead ("31 s ahead of a 30 s lease"): by wall clocks
        # the lease looks expired, but the taker watches it and sees it renewed within ttl/4.
        other_host(TTL + 1.0)
        assert not runstate.is_live(runstate.read_lease(fs, root))  # the hint is fooled; acquire is not
        t0 = time.monotonic()
        with pytest.raises(runstate.LeaseHeld, match="renewed while we watched"):
            runstate.acquire(fs, root, TTL, settle_s=0)
        refused = time.monotonic() - t0
        assert refused < TTL  # the next renewal (every ttl/4)
        assert holder.proc.poll() is None  # the first flow goes on
        # The holder stalls: alive, holding, no longer renewing. A taker whose clock is an hour behind (the
        # lease looks good for another hour) takes over after a whole TTL unrenewed on its monotonic clock.
        os.kill(holder.proc.pid, signal.SIGSTOP)
        other_host(-3600.0)
        t0 = time.monotonic()
        taken = runstate.acquire(fs, root, TTL, settle_s=0)
        waited = time.monotonic() - t0
        print(f"refused after {refused:.2f}s of watching; took over a stalled holder after {waited:.2f}s")
        assert TTL <= waited < TTL + 3, waited
        assert taken.generation == 2
        before = _commits(tmp_path, "flow-1")
        assert before
        f = fence.install(root, taken)  # the new holder commits
        try:
            write_json(fs, join(root, "commits", "taker.json"), {})
        finally:
            fence.uninstall(f)
        os.kill(holder.proc.pid, signal.SIGCONT)
        holder.wait_for("fenced:", timeout=20)
        assert holder.proc.wait(timeout=20) == 3
        assert _commits(tmp_path, "flow-1") == before  # nothing committed after the takeover
        assert runstate.read_lease(fs, root).owner == taken.owner  # and the old holder did not release ours
    finally:
        holder.kill()


def _alive_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(cmd.replace("\0", " "))
    return found


def test_a_flow_that_loses_its_lease_stops_its_components_and_they_commit_nothing_more(tmp_path):
    holder = Holder("supervise", tmp_path)
    try:
        holder.wait_for("[component] committed 2")
        fs, root = get_fs(str(tmp_path))
        old = runstate.read_lease(fs, root)
        # What a taker writes: a new owner, the next generation.
        new = runstate.Lease("taker", "node-b", 1, time.time() + 60, old.generation + 1, 0, TTL)
        write_json(fs, join(root, runstate.LEASE_FILE), new.__dict__)
        t0 = time.monotonic()
        at_steal = len(_commits(tmp_path, "component-1"))
        try:
            rc = holder.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 3, "\n".join(holder.lines)
        stopped = time.monotonic() - t0
        print(f"holder and component stopped {stopped:.2f}s after the lease was taken")
        out = "\n".join(holder.lines)
        assert "lost the lease" in out and "component stopped; lease lost: True" in out
        assert stopped < TTL / 4 + 8  # the next renewal finds the lease gone, then SIGTERM (measured 0.6-1 s)
        # at most one commit whose fence check passed just before the steal lands after it
        assert len(_commits(tmp_path, "component-1")) <= at_steal + 1
        assert _alive_mentioning(str(tmp_path)) == []
        # A component of the old generation that was not stopped (another node, say) is refused by its own fence.
        token = fence.Fence(root, old.owner, old.generation).token()
        late = subprocess.run(
            [sys.executable, str(HOLDER), "component", str(tmp_path)],
            env={**os.environ, fence.FENCE_ENV: token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert late.returncode == 3 and "fenced:" in late.stdout and "held by generation 2" in late.stdout, late
        assert "committed" not in late.stdout
    finally:
        holder.kill()


class Log:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def info(self, msg: str) -> None:
        pass

    warning = info

    def error(self, msg: str) -> None:
        self.errors.append(msg)


def test_a_holder_that_cannot_renew_stops_before_a_taker_could_take_over(tmp_path, monkeypatch):
    fs, root = get_fs(str(tmp_path))

    def storage_down(*_a, **_k):
        raise ConnectionResetError("storage unreachable")

    log, stop = Log(), threading.Event()
    with hold_lease(fs, root, 1.0, log) as keeper:
        keeper.attach(stop)
        monkeypatch.setattr(runstate, "renew", storage_down)
        t0 = time.monotonic()
        assert stop.wait(5)
        assert 0.7 <= time.monotonic() - t0 < 2.5  # 0.9 x TTL after the last good renewal (+ a loaded machine)
        with pytest.raises(runstate.LeaseLost, match="not renewed"):
            write_json(fs, join(root, "state.json"), {})
        with pytest.raises(runstate.LeaseLost):
            keeper.raise_if_lost()
    assert "not renewed" in log.errors[0]
    assert runstate.read_lease(fs, root) is not None  # a lost lease is not released: it may be someone else's
