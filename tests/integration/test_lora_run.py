"""LoRA end to end: the real CLI and processes on a shortened tiny-cpu-lora profile; adapter publications
with a checksummed base, the engine's base + adapter logprobs against the trainer's (mismatch_kl), and a
resume from the LoRA checkpoint (adapters and their optimizer state)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import cli_argv, cli_env

from storage.fs import read_manifest

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "profiles/tiny-cpu-lora.toml", ROOT / "tests/profiles/lora-short.toml"]

pytestmark = pytest.mark.slow
FS = fsspec.filesystem("file")


def _cli(out: Path, api: str, *args: str) -> None:
    proc = subprocess.run(
        cli_argv(*args), cwd=out.parent, env=cli_env(api), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_publishes_adapters_matches_the_engine_and_resumes(tmp_path, prefect_api):
    out = tmp_path / "run"
    _cli(out, prefect_api, "rl", *[t for p in PROFILES for t in ("@", str(p))], "--output-dir", str(out))
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    kls = [r["mismatch_kl"] for r in rows if r["mismatch_kl"] is not None]
    assert kls and max(kls) < 1e-6, kls  # the engine's base + adapter = the trainer's adapted model
    base = read_manifest(FS, str(out / "weights" / "step=000000"))
    m6 = read_manifest(FS, str(out / "weights" / "step=000006"))
    assert base["encoding"] == "full" and m6["encoding"] == "lora"
    assert m6["lora_base"] == {"version": 0, "path": "weights/step=000000", "model_sha256": base["model_sha256"]}
    assert m6["payload_bytes"] * 5 < m6["full_bytes"]
    assert {"adapter_model.safetensors", "adapter_config.json", "model.safetensors"} <= m6["files"].keys()
    state = torch.load(io.BytesIO((out / "checkpoints/step=000006/trainer/trainer_state.pt").read_bytes()))
    assert state["lora"] and all(".lora_" in k for k in state["lora"])

    _cli(out, prefect_api, "resume", str(out), "--max-steps", "8")
    assert [r["step"] for r in _metrics(out)] == list(range(1, 9))
    m8 = read_manifest(FS, str(out / "weights" / "step=000008"))
    assert m8["encoding"] == "lora" and m8["lora_base"]["model_sha256"] == base["model_sha256"]


@pytest.mark.long  # the whole 100-step profile (~5 min): the learning curve docs/benchmarks.md records
def test_tiny_cpu_lora_learns(tmp_path, prefect_api):
    out = tmp_path / "run"
    _cli(out, prefect_api, "rl", "@", str(PROFILES[0]), "--output-dir", str(out))
    rewards = [r["reward_mean"] for r in _metrics(out)]
    rise = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    assert rise >= 0.1, f"reward rose by {rise:.3f}: {rewards}"
    assert max(r["mismatch_kl"] or 0.0 for r in _metrics(out)) < 1e-6
