"""Advantage estimators end to end: short real runs through the `rollflow` CLI, each with another estimator, and
every committed shard checked against that estimator applied to its own rows.

`make test` runs rloo with DAPO's overlong shaping, together with other algorithm settings, in
tests/integration/test_algorithms_run.py; this module's run of it (a barely warmed-up model writes long completions, so
the penalty is non-zero); the runs of the other built-ins and of the plugin estimator (tests/plugins/pkg/toyalgos,
by entry point) are `long`. Every step's `advantage` column must equal the estimator applied, per group, to the
step's shaped rewards (`reward` + the row's `overlong_penalty` metric), the manifest must count the groups whose
advantages are all 0, and the trainer must report the penalty's mean.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import cli_argv, cli_env

from config.advantage import AdvantageConfig
from tests.algo_fixture import PKG, ROOT, check_steps, write_site

pytestmark = pytest.mark.slow
STEPS = 3


def _run(tmp_path: Path, *overrides: str) -> Path:
    site = write_site(tmp_path / "site")
    env = cli_env(None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PKG), str(site)])
    out = tmp_path / "run"
    args = ["rl", "@", str(ROOT / "profiles/tiny-cpu.toml"), "--output-dir", str(out), "--max-steps", str(STEPS)]
    args += ["--sft.steps", "5", "--orchestrator.batch-size", "8", "--tracking.mlflow", "false", *overrides]
    proc = subprocess.run(cli_argv(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long  # make test runs rloo with overlong shaping in tests/integration/test_algorithms_run.py
def test_rloo_with_overlong_shaping(tmp_path):
    out = _run(tmp_path, "--orchestrator.advantage.type", "rloo", "--orchestrator.overlong.buffer", "4")
    penalties = check_steps(out, AdvantageConfig(type="rloo"), STEPS)
    assert all(p is not None and -1.0 <= p <= 0.0 for p in penalties)
    assert any(p < 0 for p in penalties), "a 5-step warm-up writes long completions: some must be penalised"
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(-1.0 <= m["env/overlong_penalty"] <= 0.0 for m in metrics)
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "zero-advantage groups" in log


LONG = {
    "grpo": ([], AdvantageConfig()),
    "grpo-centred": (["--orchestrator.advantage.normalize-std", "false"], AdvantageConfig(normalize_std=False)),
    "reinforce_pp": (["--orchestrator.advantage.type", "reinforce_pp"], AdvantageConfig(type="reinforce_pp")),
    "plugin": (
        ["--orchestrator.advantage", '{type = "rank", args = {scale = 2.0}}'],
        AdvantageConfig(type="rank", args={"scale": 2.0}),
    ),
}


@pytest.mark.long
@pytest.mark.parametrize("case", sorted(LONG))
def test_each_estimator_end_to_end(tmp_path, monkeypatch, case):
    overrides, advantage = LONG[case]
    out = _run(tmp_path, *overrides)
    monkeypatch.syspath_prepend(str(PKG))  # the plugin's module, for re-applying it here
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert set(check_steps(out, advantage, STEPS)) == {None}  # no shaping: no penalty recorded
    assert "env/overlong_penalty" not in _metrics(out)[-1]
