"""Each policy-loss variant through the real CLI: `[trainer.loss] type = ...`, several optimizer steps per
rollout step against the proximal policy, the reference KL and the entropy term, read back from metrics.jsonl.

One combined run is in `make test`; one short run per variant is marked `long` (`make test-long`).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from conftest import TINY, cli_argv, cli_env

from config.loss import BUILTIN_LOSSES

pytestmark = pytest.mark.slow

SHORT = ("--sft.steps", "20", "--orchestrator.batch-size", "8", "--tracking.mlflow", "false", "--async-level", "0")


def _run(out: Path, api: str, *extra: str) -> list[dict]:
    args = ["rl", "@", str(TINY), "--output-dir", str(out), *SHORT, *extra]
    env = cli_env(api)
    proc = subprocess.run(cli_argv(*args), cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_decoupled_ppo_with_reference_kl_and_entropy(tmp_path, prefect_api):
    rows = _run(
        tmp_path / "run",
        prefect_api,
        "--max-steps", "4", "--trainer.loss.type", "ppo_clip", "--trainer.loss.old-policy", "proximal",
        "--trainer.mini-batches", "2", "--trainer.epochs", "2", "--trainer.loss.aggregation", "sequence_mean",
        "--trainer.reference.kl-coef", "0.01", "--trainer.loss.entropy-coef", "0.001",
        "--trainer.loss.zero-advantage", "filter",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["optimizer_steps"] == 4 for r in rows)  # 2 mini-batches x 2 epochs
    # the first optimizer step's ratio against the proximal policy is exactly 1; later ones move and get clipped
    assert all(r["ratio_min"] < 1 < r["ratio_max"] for r in rows)
    assert any(r["clipped_fraction"] > 0 for r in rows)
    # the policy leaves version 0, the reference, as it trains: its KL grows from the first step's
    assert 0 < rows[0]["ref_kl"] < rows[-1]["ref_kl"]
    assert all(0 < r["entropy"] < math.log(64) for r in rows)
    assert all(0 <= r["zero_advantage_fraction"] <= 1 for r in rows)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


@pytest.mark.long
@pytest.mark.parametrize("variant", sorted(BUILTIN_LOSSES))
def test_each_loss_variant_runs(tmp_path, prefect_api, variant):
    rows = _run(tmp_path / "run", prefect_api, "--max-steps", "3", "--trainer.loss.type", variant)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["optimizer_steps"] == 1
        assert r["mismatch_kl"] is not None and r["mismatch_kl"] <= 1e-7  # same fp32 weights: rounding only
        assert 0 <= r["masked_fraction"] <= 1 and 0 <= r["clipped_fraction"] <= 1
