"""profiles/tiny-cpu-fsdp2.toml through the real `rollflow rl` flow (the trainer as 2 gloo ranks under
torchrun): one rank SIGKILLed mid-run (the flow restarts the attempt from the last checkpoint), then the
whole tree killed and the run resumed with ONE trainer rank (a 2 -> 1 rank resume of DCP checkpoints).
The resume audit of tests/integration/test_resume.py must pass: every step exactly once, unique sample
ids, staleness within bound, every policy version published."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, descendants, start_cli
from test_resume import (
    RESUME,
    _assert_nothing_lost_or_duplicated,
    _checkpoints,
    _committed_rollouts,
    _wait_for_progress,
    _wait_gone,
)

pytestmark = pytest.mark.slow
FSDP2 = ROOT / "profiles" / "tiny-cpu-fsdp2.toml"


def _ranks(cli_pid: int) -> list[int]:
    """The trainer's rank processes (not torchrun's agent)."""
    found = []
    for pid in descendants(cli_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "config/trainer.json" in cmd and "engines.trainer.torchrun" not in cmd:
            found.append(pid)
    return found


def test_fsdp2_run_survives_a_killed_rank_and_resumes_on_one_rank(tmp_path, prefect_api):
    out, log = tmp_path / "run", tmp_path / "cli.log"
    args = ("rl", "@", str(FSDP2), "@", str(RESUME), "--max-steps", "6", "--tracking.mlflow", "false")
    cli = start_cli(tmp_path, log, prefect_api, *args, "--output-dir", str(out))
    snapshots: dict[int, str] = {}
    try:
        assert _wait_for_progress(cli, out, [], timeout_s=240), log.read_text()[-3000:]
        deadline = time.monotonic() + 60
        while len(ranks := _ranks(cli.pid)) < 2:
            assert time.monotonic() < deadline, "no 2 trainer ranks to kill"
            time.sleep(0.1)
        snapshots.update(_committed_rollouts(out))
        os.kill(ranks[-1], signal.SIGKILL)  # one rank: torchrun fails the trainer, the flow restarts it
        first = _checkpoints(out)
        assert _wait_for_progress(cli, out, first, timeout_s=240), log.read_text()[-3000:]
        snapshots.update(_committed_rollouts(out))
        for pid in [cli.pid, *descendants(cli.pid)]:  # the whole tree; the ranks die with their agent
            os.kill(pid, signal.SIGKILL)
        cli.wait()
        _wait_gone(out)
        cli = start_cli(tmp_path, log, prefect_api, "resume", str(out), "--trainer.parallel.world-size", "1")
        assert cli.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    text = log.read_text()
    assert "restart 1/" in text, "the killed rank did not make the flow restart the trainer"
    launches = [line for line in text.splitlines() if "starting trainer:" in line]
    assert "engines.trainer.torchrun --standalone --nproc-per-node 2" in launches[0]
    assert "torchrun" not in launches[-1]  # the resume ran the trainer as one plain process
    _assert_nothing_lost_or_duplicated(out, 6, snapshots)
    _wait_gone(out)
