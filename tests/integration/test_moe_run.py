"""MoE end to end through the real CLI: a shortened tiny-moe-cpu run (tests/profiles/moe-short.toml)
commits non-null routing payloads and trains with router replay; a killed-and-resumed copy of the run
commits the same samples, the same payloads and the same final weights."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from conftest import ROOT, descendants, processes_mentioning, start_cli
from safetensors.torch import load_file

from config.loader import load_run_config
from storage import rollouts

pytestmark = pytest.mark.slow
PROFILES = (ROOT / "profiles" / "tiny-moe-cpu.toml", ROOT / "tests" / "profiles" / "moe-short.toml")
ARGS = ("rl", *[t for p in PROFILES for t in ("@", str(p))])


def _table(out: Path):
    return ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_routing_payloads(out: Path) -> None:
    cfg = load_run_config(list(PROFILES))
    table = _table(out)  # pyarrow alone
    assert table.column("routed_experts").null_count == 0
    rollouts.check_routed_experts(table)  # the schema check the writer applies
    for row in table.slice(0, 5).to_pylist():
        routes = np.array(row["routed_experts"], dtype=np.int16)
        seq = len(row["prompt_ids"]) + len(row["completion_ids"]) - 1
        assert routes.shape == (seq, cfg.model.num_layers, cfg.model.num_experts_per_tok)
        assert routes.min() >= 0 and routes.max() < cfg.model.num_experts
        assert all(len(set(t)) == len(t) for t in routes.reshape(-1, routes.shape[-1]).tolist())


def _assert_replay_in_effect(out: Path) -> None:
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert all(r["replayed_fraction"] == 1.0 for r in rows)  # every scored token used the sampler's experts
    # fp32 sampler and trainer, same weights, replayed routing: measured expert_mismatch 0 and mismatch_kl 0.0 at
    # every step. The bounds allow a router near-tie flipping a few tokens and float rounding (dense runs: ~5e-9).
    print(f"mismatch_kl {[r['mismatch_kl'] for r in rows]}, expert_mismatch {[r['expert_mismatch'] for r in rows]}")
    assert all(r["expert_mismatch"] is not None and 0.0 <= r["expert_mismatch"] <= 0.01 for r in rows)
    kls = [r["mismatch_kl"] for r in rows if r["mismatch_kl"] is not None]
    assert kls and max(kls) <= 1e-7


def _samples(out: Path) -> dict[str, tuple]:
    t = _table(out)
    cols = [t.column(c).to_pylist() for c in ("sample_id", "step", "completion_ids", "routed_experts")]
    return {sid: (step, tuple(ids), json.dumps(r)) for sid, step, ids, r in zip(*cols, strict=True)}


def _checkpoints(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.iterdir() if (p / "trainer" / "_manifest.json").exists())


def _kill_after_first_checkpoint(cli, out: Path) -> None:
    deadline = time.monotonic() + 240
    while not ((out / "checkpoints").exists() and _checkpoints(out)):
        assert cli.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.1)
    time.sleep(0.5)  # into the next steps: that work is lost and redone
    for pid in [cli.pid, *descendants(cli.pid)]:
        os.kill(pid, signal.SIGKILL)
    cli.wait()
    deadline = time.monotonic() + 30
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(out)) == []


def test_moe_run_keeps_routing_payloads_replays_them_and_resumes_exactly(tmp_path, prefect_api):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    log = tmp_path / "a.log"
    # The two runs side by side: one group request at a time and one thread per process, so sharing the cores
    # changes their timing only, never their numbers; it halves the test's wait.
    first = start_cli(tmp_path, log, prefect_api, *ARGS, "--output-dir", str(straight))
    cli = start_cli(tmp_path, tmp_path / "b.log", prefect_api, *ARGS, "--output-dir", str(resumed))
    _kill_after_first_checkpoint(cli, resumed)
    assert first.wait(300) == 0, log.read_text()[-3000:]
    _assert_routing_payloads(straight)
    _assert_replay_in_effect(straight)
    assert _checkpoints(resumed)[-1] < 4, "killed after the last checkpoint: nothing left to resume"
    resume = start_cli(tmp_path, tmp_path / "b.log", prefect_api, "resume", str(resumed))
    assert resume.wait(300) == 0, (tmp_path / "b.log").read_text()[-3000:]

    a, b = _samples(straight), _samples(resumed)
    assert a.keys() == b.keys() and a == b  # same samples and the same routing payloads
    wa = load_file(straight / "weights" / "step=000004" / "model.safetensors")
    wb = load_file(resumed / "weights" / "step=000004" / "model.safetensors")
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    print(f"final weights: max |difference| = {worst:.2e}")
    assert worst <= 1e-5  # the documented tolerance (docs/resume.md)
