"""A model family from outside rollflow through the real CLI: `mini_llama` (tests/plugins/pkg/toyfamilies),
registered by an entry point that only the run's PYTHONPATH carries (as `pip install` of a package would),
and a model directory of that `model_type`. Every process resolves the family from the entry point: the
warm-up, the trainer and the inference engine run it on rollflow's decoder (`impl = custom`), the trainer
and the sampler agree on every token's logprob, and the publications are that family's directories.

`make test-long`: tests/unit/test_family_plugins.py resolves the same plugin through the CLI in a fresh process
within `make test`, which keeps this whole run (about a minute) out of its 25-minute budget."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import cli_argv, cli_env

from tests.family_fixture import PKG, ROOT, mini_llama_dir, write_site

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_a_run_of_a_plugin_family_model(tmp_path):
    _, mini = mini_llama_dir(tmp_path / "models")
    site = write_site(tmp_path / "site")
    env = cli_env(None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PKG), str(site)])
    out = tmp_path / "run"
    args = ["rl", "@", str(ROOT / "profiles/tiny-cpu.toml"), "--model.path", str(mini), "--output-dir", str(out)]
    args += ["--model.max-seq-len", "128", "--max-steps", "2", "--sft.steps", "5", "--orchestrator.batch-size", "8"]
    proc = subprocess.run(cli_argv(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for component in ("warmup", "trainer", "inference"):
        log = (out / "logs" / f"{component}.log").read_text()
        assert f"family mini_llama, impl custom, from {mini}" in log, component
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch_kl"] <= 1e-9 for r in rows)  # the engine and the trainer run the same decoder
    for version in (0, 2):
        config = json.loads((out / "weights" / f"step={version:06d}" / "config.json").read_text())
        assert (config["model_type"], config["ffn_dim"]) == ("mini_llama", 48)
    assert "intermediate_size" not in config  # the directory's own config.json, as the family reads it
