"""A live component that makes no progress, in a real `rollflow rl` run: the flow's stall watch (runtime/stall.py,
restart.stall.*) stops it within its stall timeout, says what was stuck, restarts the attempt from the last
checkpoint, and the run completes with the resume audit of tests/integration/test_resume.py passing.

  - SIGSTOP of the trainer, then of the inference server (it still accepts connections: the kernel does),
    then of the orchestrator, one after the other in one run;
  - a weight update that never returns (tests/plugins/pkg/hangbackend: the embedded backend whose update to
    one version hangs once);
  - a collective that never completes: one of two gloo trainer ranks under torchrun SIGSTOPped, the other
    blocked in FSDP's next all-gather.
Each costs a whole run (a minute or more on 2 cores): `make test-long`. tests/unit/test_stall.py keeps a
SIGSTOPped and a frozen real process under `supervise` in `make test`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, start_cli
from test_parallel_run import FSDP2, _ranks
from test_resume import (
    RL_ARGS,
    _assert_nothing_lost_or_duplicated,
    _checkpoints,
    _committed_rollouts,
    _component_pid,
    _wait_for_progress,
)

from storage.runstate import pid_alive
from tests.unit.test_inference_plugins import PKG

pytestmark = [pytest.mark.slow, pytest.mark.long]
# every floor: a loaded 2-core machine (load 14) stretched one gloo warm-up step past 8 s
TIMEOUT_S = 20.0
STALL = [
    *("--restart.stall.trainer-s", str(TIMEOUT_S), "--restart.stall.orchestrator-s", str(TIMEOUT_S)),
    *("--restart.stall.inference-s", str(TIMEOUT_S), "--restart.stall.heartbeat-s", "0.5"),
    *("--restart.stall.startup-s", "120", "--tracking.mlflow", "false"),
]
DETECT_S = 60.0  # SIGSTOP to the process gone: the timeout (or 5 x the slowest stretch), a poll, the stop


def _stop_and_time(pid: int) -> float:
    """SIGSTOP `pid`; seconds until the flow has stopped it (it never resumes on its own)."""
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    while pid_alive(pid):
        assert time.monotonic() - t0 < 120, f"process {pid} stopped by SIGSTOP was not detected in 120 s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _pid(cli, target: str) -> int:
    deadline = time.monotonic() + 60
    while (pid := _component_pid(cli.pid, target)) is None:
        assert cli.poll() is None and time.monotonic() < deadline, f"no {target} process"
        time.sleep(0.05)
    return pid


def _finish(cli, log: Path, out: Path, max_steps: int, snapshots: dict[int, str]) -> str:
    assert cli.wait(timeout=600) == 0, log.read_text()[-4000:]
    _assert_nothing_lost_or_duplicated(out, max_steps, snapshots)
    return log.read_text()


def _kill_tree(cli) -> None:
    if cli.poll() is None:
        os.killpg(cli.pid, signal.SIGKILL)


def test_sigstopped_trainer_inference_and_orchestrator_are_restarted(tmp_path, prefect_api):
    out, log, steps = tmp_path / "run", tmp_path / "cli.log", 16
    cli = start_cli(tmp_path, log, prefect_api, *RL_ARGS, "--max-steps", str(steps), *STALL, "--output-dir", str(out))
    snapshots: dict[int, str] = {}
    detected: dict[str, float] = {}
    try:
        for target in ("trainer", "inference", "orchestrator"):
            assert _wait_for_progress(cli, out, _checkpoints(out), timeout_s=300), log.read_text()[-3000:]
            snapshots.update(_committed_rollouts(out))
            detected[target] = _stop_and_time(_pid(cli, target))
        text = _finish(cli, log, out, steps, snapshots)
    finally:
        _kill_tree(cli)
    print(f"SIGSTOP to stopped, seconds: {detected}")
    for target, seconds in detected.items():
        stuck = [line for line in text.splitlines() if f"{target} is stuck: " in line]
        assert stuck and "no heartbeat for" in stuck[0], f"no stall of the stopped {target} in the log: {stuck}"
        assert seconds < DETECT_S, (target, seconds)  # from the SIGSTOP; the timeout runs from the last beat
        quiet = int(re.search(r"for (\d+)s \(timeout (\d+)s\)", stuck[0]).group(1))  # type: ignore[union-attr]
        assert quiet >= TIMEOUT_S, stuck[0]  # never before its timeout
    assert text.count("restart 1/") >= 3  # each stall restarted the attempt (after progress: a fresh count)


def test_a_hung_weight_update_restarts_the_attempt(tmp_path, prefect_api, monkeypatch):
    site = tmp_path / "site" / "hangbackend-0.1.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: hangbackend\nVersion: 0.1\n")
    (site / "entry_points.txt").write_text("[rollflow.inference_backends]\nhang-update = hangbackend:BACKEND\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site.parent), str(PKG), str(ROOT)]))
    monkeypatch.setenv("HANG_UPDATE_AT", "3")
    out, log, steps = tmp_path / "run", tmp_path / "cli.log", 8
    args = (*RL_ARGS, "--max-steps", str(steps), "--inference.backend", "hang-update", *STALL)
    cli = start_cli(tmp_path, log, prefect_api, *args, "--output-dir", str(out))
    try:
        text = _finish(cli, log, out, steps, {})
    finally:
        _kill_tree(cli)
    assert (out / "hung-update").exists(), "the update never hung"
    assert "hanging the update to version 3" in text
    stuck = [line for line in text.splitlines() if " is stuck: " in line]
    assert stuck and "inference is stuck: no progress for" in stuck[0], stuck
    assert "1 held" in text  # the state lines name the held update


def test_a_stopped_rank_in_a_collective_restarts_the_attempt(tmp_path, prefect_api):
    out, log, steps = tmp_path / "run", tmp_path / "cli.log", 6
    args = ("rl", "@", str(FSDP2), "@", str(ROOT / "tests/profiles/resume.toml"), "--max-steps", str(steps), *STALL)
    cli = start_cli(tmp_path, log, prefect_api, *args, "--output-dir", str(out))
    try:
        assert _wait_for_progress(cli, out, [], timeout_s=300), log.read_text()[-3000:]
        snapshots = _committed_rollouts(out)
        deadline = time.monotonic() + 60
        while len(ranks := _ranks(cli.pid)) < 2:
            assert time.monotonic() < deadline, "no 2 trainer ranks"
            time.sleep(0.1)
        seconds = _stop_and_time(ranks[-1])
        text = _finish(cli, log, out, steps, snapshots)
    finally:
        _kill_tree(cli)
    print(f"SIGSTOP of rank 1 to stopped: {seconds:.1f}s")
    stuck = [line for line in text.splitlines() if "trainer rank" in line and " is stuck: " in line]
    # the stopped rank is silent; the other, blocked in the collective, has stopped moving: either may be first
    assert stuck and ("rank 1 is stuck: " in stuck[0] and "no heartbeat" in stuck[0] or "rank 0 is stuck" in stuck[0])
    assert seconds < DETECT_S
