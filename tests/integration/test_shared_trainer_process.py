"""The shared trainer's process entry, `python -m engines.trainer.shared --config D/config/shared_trainer.json`,
as a real subprocess on a real deployment directory: a tenant with committed rollouts trains to max_steps and is
finished; a second tenant waits (its status refreshed for its flow's stall watch) until its rollouts are
committed, then trains, checkpointing after its next step on SIGUSR1; a removed record leaves; the heartbeat
reports a server; SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config.model import LoRAConfig
from config.stall import HEARTBEAT_ENV, split_beat
from storage.fs import read_json
from storage.tenants import read_status, remove_tenant
from tests.shared_trainer_fixture import commit_rollouts, deployment, tenant

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
LORA = LoRAConfig(rank=4, alpha=8.0)


def _wait(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def _state(t: Path) -> tuple[str, int] | None:
    status = read_status(str(t))
    return None if status is None else (status.state, status.step)


def test_the_process_trains_tenants_as_their_records_come_and_go(tmp_path):
    d, ta, tb = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta"
    config = deployment(d, poll_s=0.2)
    tenant(d, ta, LORA, seed=1, steps=3, max_steps=3)
    tenant(d, tb, LORA, seed=2, steps=0, max_steps=3)
    env = {**os.environ, "PYTHONPATH": str(ROOT), HEARTBEAT_ENV: "0.5", "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "shared.log").open("w")
    cmd = [sys.executable, "-m", "engines.trainer.shared", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _state(ta) == ("finished", 3))
        assert _state(tb) == ("waiting", 0)
        first = read_status(str(tb))
        _wait(lambda: read_status(str(tb)).updated > first.updated)  # type: ignore[union-attr]  # refreshed
        proc.send_signal(signal.SIGUSR1)  # a checkpoint after beta's next step (1), besides interval 2 and the end
        time.sleep(0.5)  # the handler runs on the loop's next bytecode; the loop idles in 0.05 s sleeps
        for step in (1, 2, 3):
            commit_rollouts(tb, step, seed=2)
        _wait(lambda: _state(tb) == ("finished", 3))
        remove_tenant(str(d), "alpha")
        _wait(lambda: set(read_json(str(d / "shared_trainer.json"))["tenants"]) == {"beta"})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    out = (tmp_path / "shared.log").read_text()
    beats = [b for _, b in map(split_beat, out.split("\n")) if b is not None]  # splitlines() splits at the \x1e
    assert beats and beats[-1].progress > 0, out[-2000:]
    assert (ta / "weights" / "step=000003").exists()
    assert sorted(p.name for p in (tb / "checkpoints").iterdir()) == ["step=000001", "step=000002", "step=000003"]
    assert "shared trainer stopped" in out
