"""On-policy distillation end to end: the real CLI with a `[teacher]`, so the flow runs a second inference
server, the orchestrator scores every sample there, and the trainer learns from per-token advantages.

The teacher is a model directory this test makes: the built-in model (a small shape, to stay fast) after a
short supervised warm-up of its own (engines/trainer/sft.py, a publication dir `weights/step=000000/`). The
student barely warms up (5 steps) and distils for a few synchronous steps (pure distillation,
reward_coef 0). Checked: the lake's teacher logprobs are the teacher model's own logprobs of the sampled
tokens (recomputed here with the trainer's code), the token advantages are their gap to the sampler's, and
`teacher_kl` is reported every step and falls.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import torch
from conftest import cli_argv, cli_env

from config.model import ModelConfig
from config.process import ComponentPaths, SFTProcessConfig
from config.run import RunConfig
from config.sft import SFTConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SHAPE = {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}
STEPS = 4


def _teacher(tmp_path: Path) -> Path:
    """A trained teacher: 60 supervised steps of the small model, published as a model directory."""
    from engines.trainer.sft import run_sft

    base = RunConfig()
    out = tmp_path / "teacher-run"
    run_sft(
        SFTProcessConfig(
            run=ComponentPaths(output_dir=str(out), run_id="teacher", storage=base.storage),
            model=ModelConfig(**SHAPE),
            envs=base.envs,
            sft=SFTConfig(steps=60, batch_size=32, lr=1e-2),
            num_threads=1,
            seed=1,
        )
    )
    return out / "weights" / "step=000000"


def _teacher_logprobs(directory: Path, prompts: list, completions: list) -> list[torch.Tensor]:
    from engines.models import modeldir
    from engines.models.decoder import token_logprobs

    model = modeldir.load(ModelConfig(path=str(directory)), pretrained=True).model.eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.tensor([p + c])
            out.append(token_logprobs(model(ids)[:, :-1], ids[:, 1:], 1.0)[0, len(p) - 1 :])
    return out


def test_distillation_run(tmp_path, prefect_api):
    teacher = _teacher(tmp_path)
    out = tmp_path / "run"
    shape = [t for k, v in SHAPE.items() for t in (f"--model.{k.replace('_', '-')}", str(v))]
    args = ["rl", "@", str(ROOT / "profiles/tiny-cpu.toml"), "--output-dir", str(out), "--max-steps", str(STEPS)]
    args += ["--sft.steps", "5", "--orchestrator.batch-size", "8", "--async-level", "0", "--tracking.mlflow", "false"]
    args += [*shape, "--teacher.path", str(teacher)]
    env = cli_env(prefect_api)
    proc = subprocess.run(cli_argv(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "config" / "teacher.json").exists() and (out / "logs" / "teacher.log").exists()

    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()
    rows = table.to_pylist()
    assert all(r["teacher_logprobs"] is not None and r["token_advantages"] is not None for r in rows)
    sample = rows[:: max(1, len(rows) // 16)]  # 16 samples over the steps
    want = _teacher_logprobs(teacher, [r["prompt_ids"] for r in sample], [r["completion_ids"] for r in sample])
    gap = max(float((torch.tensor(r["teacher_logprobs"]) - w).abs().max()) for r, w in zip(sample, want, strict=True))
    print(f"teacher logprobs (served) vs the teacher model's: max |diff| {gap:.1e}")
    assert gap < 1e-5
    for r in rows:  # kl_coef 1, reward_coef 0: the advantage is the gap, rounded to float32
        mixed = torch.tensor(r["teacher_logprobs"]) - torch.tensor(r["completion_logprobs"])
        assert torch.allclose(torch.tensor(r["token_advantages"]), mixed, atol=1e-6, rtol=0)

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kls = [m["teacher_kl"] for m in metrics]
    print(f"teacher_kl per step: {[round(k, 4) for k in kls]}")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)) and all(k > 0 for k in kls)
    assert kls[-1] < kls[0] - 0.05, f"the student did not move toward the teacher: teacher_kl {kls}"
