"""Learning check (long): profiles/tiny-cpu-fsdp2.toml (2 FSDP2 ranks) learns as the single-process
tiny-cpu profile does: the mean reward of the last 5 steps exceeds the first 5 by >= 0.1, for both,
run one after the other on the same machine. Figures measured here: docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, cli_argv, cli_env

pytestmark = pytest.mark.long


def _rise(out: Path, profile: str) -> float:
    args = ["rl", "@", str(ROOT / "profiles" / profile), "--output-dir", str(out), "--tracking.mlflow", "false"]
    proc = subprocess.run(cli_argv(*args), cwd=out.parent, env=cli_env(None), capture_output=True, text=True,
                          timeout=3600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


def test_the_fsdp2_profile_learns_like_the_single_process_one(tmp_path):
    fsdp2 = _rise(tmp_path / "fsdp2", "tiny-cpu-fsdp2.toml")
    single = _rise(tmp_path / "single", "tiny-cpu.toml")
    print(f"reward rise: fsdp2 {fsdp2:.3f}, single process {single:.3f}")
    assert fsdp2 >= 0.1 and single >= 0.1, (fsdp2, single)
