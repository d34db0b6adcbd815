"""Model family plugins: `mini_llama` from a package outside rollflow (tests/plugins/pkg/toyfamilies),
registered by a real entry point (a dist-info written on the path), resolves everywhere a family is
resolved: `model.family` at load (the CLI, in a fresh process), a directory's config.json `model_type`
(its own field names mapped, `model.impl` auto/custom decided by its check), and a publication's
config.json. The model it maps onto rollflow's decoder scores exactly as the same weights under `llama`.
A short real run through the CLI: tests/integration/test_family_plugin_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config.model import ModelConfig
from config.registry import MODEL_FAMILIES, MODEL_FAMILY_GROUP, registered
from engines.models import families, modeldir
from engines.models.decoder import token_logprobs
from engines.registry import PluginError
from tests.family_fixture import PKG, ROOT, SHAPE, mini_llama_dir, write_site

TINY = ROOT / "profiles" / "tiny-cpu.toml"


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Put toyfamilies and a dist-info registering `entries` on the path (undone after the test)."""

    def put(entries: str = "mini_llama = toyfamilies:MINI_LLAMA") -> None:
        monkeypatch.syspath_prepend(str(PKG))
        monkeypatch.syspath_prepend(str(write_site(tmp_path / "site", entries)))

    yield put
    sys.modules.pop("toyfamilies", None)


@pytest.fixture
def installed(install):
    install()


def test_the_entry_point_registers_the_family_beside_the_built_in_ones(installed):
    assert registered(MODEL_FAMILY_GROUP, MODEL_FAMILIES)["mini_llama"] == "toyfamilies:MINI_LLAMA"
    assert set(families.registered()) == {"llama", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "mini_llama"}
    assert ModelConfig(family="mini_llama").family_name == "mini_llama"


def test_a_directory_of_the_new_model_type_runs_on_the_decoder_as_the_same_weights_under_llama(installed, tmp_path):
    llama, mini = mini_llama_dir(tmp_path)
    source = modeldir.resolve(ModelConfig(path=str(mini)))
    assert (source.impl, source.cfg.family_name, source.cfg.intermediate_size) == ("custom", "mini_llama", 48)
    a = modeldir.load(ModelConfig(path=str(llama)), pretrained=True).model
    b = modeldir.load(ModelConfig(path=str(mini)), pretrained=True).model
    ids = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(
            token_logprobs(a(ids)[:, :-1], ids[:, 1:], 1.0), token_logprobs(b(ids)[:, :-1], ids[:, 1:], 1.0)
        )


def test_the_built_in_model_under_the_new_family_publishes_its_config_json(installed):
    cfg = ModelConfig(family="mini_llama", **SHAPE)
    data = families.hf_config(cfg, 50, {"bos": 1, "eos": 2, "pad": 0})
    assert data["model_type"] == "mini_llama" and data["architectures"] == ["LlamaForCausalLM"]
    assert data["ffn_dim"] == 48 and data["mlp_bias"] is False
    assert families.model_fields(data)["intermediate_size"] == 48  # it reads back as it was written


def test_the_familys_check_decides_custom_or_hf(installed, tmp_path):
    _, mini = mini_llama_dir(tmp_path)
    config = json.loads((mini / "config.json").read_text())
    (mini / "config.json").write_text(json.dumps({**config, "parallel_residual": True}))
    with pytest.raises(modeldir.ModelDirError, match=r"model.impl='custom' cannot run it: parallel_residual=true"):
        modeldir.resolve(ModelConfig(path=str(mini), impl="custom"))
    assert modeldir.resolve(ModelConfig(path=str(mini))).impl == "hf"  # auto: transformers' modeling


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("mini_llama = toyfamilies:NOT_A_FAMILY", "is a str, not an engines.models.families.Family"),
        ("tiny_llama = toyfamilies:MINI_LLAMA", "registered under another name than its model_type 'mini_llama'"),
    ],
)
def test_a_bad_registration_is_refused_naming_it(install, entries, message):
    install(entries)
    with pytest.raises(PluginError, match=message):
        families.registered()


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PKG), str(site)])}
    cmd = [sys.executable, "-m", "rollflow.cli", "rl", "@", str(TINY), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_the_cli_accepts_the_family_and_its_model_type_in_a_fresh_process(tmp_path):
    site = write_site(tmp_path / "site")
    r = _cli(site, "--model.family", "mini_llama", "--output-dir", str(tmp_path / "a"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "a" / "config" / "trainer.json").read_text())["model"]["family"] == "mini_llama"
    r = _cli(site, "--model.family", "maxi_llama", "--output-dir", str(tmp_path / "b"), "--dry-run")
    assert r.returncode == 2 and "unknown model family 'maxi_llama'" in r.stderr and "mini_llama" in r.stderr
    _, mini = mini_llama_dir(tmp_path)
    # instruct prompts through the character tokenizer take ~60 tokens: the load step measures them
    r = _cli(
        site, "--model.path", str(mini), "--model.max-seq-len", "128", "--output-dir", str(tmp_path / "c"), "--dry-run"
    )
    assert r.returncode == 0, r.stderr
