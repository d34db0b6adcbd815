"""Collective weight transport over real gloo groups on loopback: a trainer-side `Sender` in a separate
process (or this one) and the engine-side `Receiver`; restarts of either side re-form the group."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from config.transport import WeightBroadcastConfig
from engines.weight_transport import Receiver, Sender
from runtime.rundir import free_port

pytestmark = pytest.mark.slow


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}


def _wait_staged(rx: Receiver, version: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := rx.take(version)) is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"version {version} never arrived: {rx.stats}")


SENDER = """
import sys, torch
from config.transport import WeightBroadcastConfig
from engines.weight_transport import Sender
sys.path.insert(0, "tests/integration")
from test_weight_transport import _state
cfg = WeightBroadcastConfig(type="collective", port=int(sys.argv[1]), timeout_s=10)
print(Sender(cfg).send(int(sys.argv[2]), _state(int(sys.argv[2]))), flush=True)
"""


@pytest.fixture()
def cfg():
    return WeightBroadcastConfig(type="collective", port=free_port("127.0.0.1"), timeout_s=5)


def test_versions_arrive_exactly_and_a_restarted_trainer_rejoins(cfg):
    rx = Receiver(cfg)
    try:
        assert Sender(cfg).send(1, _state(1)) is not None  # the first trainer, then it goes away
        argv = [sys.executable, "-c", SENDER, str(cfg.port), "2"]  # a restarted trainer: a new process
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() != "None", proc.stdout + proc.stderr[-2000:]
        for version in (1, 2):
            got, want = _wait_staged(rx, version), _state(version)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            assert got["b.bias"].dtype == torch.bfloat16
        assert rx.stats["generations"] == 2 and rx.stats["received"] == 2
    finally:
        rx.stop()


def test_a_restarted_engine_is_rejoined_and_a_missing_one_costs_a_bounded_wait(cfg):
    tx = Sender(cfg.model_copy(update={"timeout_s": 2}))
    t0 = time.monotonic()
    assert tx.send(1, _state(1)) is None  # nobody listening: refused, within the bound
    assert time.monotonic() - t0 < 15
    rx = Receiver(cfg)
    assert tx.send(2, _state(2)) is not None and torch.equal(_wait_staged(rx, 2)["a.weight"], _state(2)["a.weight"])
    rx.stop()
    rx._thread.join(5)
    del rx
    rx2 = Receiver(cfg)  # the engine restarted on the same port: a fresh store, generation 1 again
    try:
        assert tx.send(3, _state(3)) is not None
        assert torch.equal(_wait_staged(rx2, 3)["a.weight"], _state(3)["a.weight"])
        assert rx2.take(2) is None  # what the old engine staged is gone with it
    finally:
        rx2.stop()


@pytest.mark.long  # a whole flow run (~40 s idle); the transport itself is covered by the tests above
def test_a_collective_run_serves_every_version_from_the_group(tmp_path, prefect_api):
    import json
    from pathlib import Path

    from conftest import cli_argv, cli_env

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    profiles = ["@", str(root / "profiles/tiny-cpu.toml"), "@", str(root / "tests/profiles/collective-short.toml")]
    argv = cli_argv("rl", *profiles, "--output-dir", str(out))
    proc = subprocess.run(argv, cwd=tmp_path, env=cli_env(prefect_api), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["broadcast_s"] is not None for r in rows)
    kls = [r["mismatch_kl"] for r in rows if r["mismatch_kl"] is not None]
    assert kls and max(kls) < 1e-6, kls  # the same weights as the files: mismatch_kl as with the filesystem
    log = (out / "logs" / "orchestrator.log").read_text()
    served = [line for line in log.splitlines() if "engine now serves policy version" in line]
    assert served and all("from collective" in line for line in served), served
    assert (out / "weights" / "step=000006" / "model.safetensors").exists()  # still published
