"""`inference.backend = "auto"` (engines/inference/auto.py): the parameter count without torch, the choice (size,
vLLM environment, the vllm backend's capability check), and the CLI storing the choice in the run's config."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from config.loader import load_run_config
from config.model import ModelConfig
from engines.inference.auto import choose, count_params, keep_stored, model_params, resolve_auto
from rollflow.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "profiles" / "tiny-cpu.toml"
SMOL = {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536}


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"tie_word_embeddings": False, "qk_norm": True, "head_dim": 48},
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96},
    ],
)
def test_the_count_equals_the_built_models_parameters(shape):
    import torch

    from engines.models.decoder import CausalLM

    mc = ModelConfig().model_copy(update=shape)
    torch.manual_seed(0)
    built = sum(p.numel() for p in CausalLM(mc, 300).parameters())
    assert count_params(mc, 300) == built


def test_smollm2_135m_shape_counts_its_published_size():
    assert count_params(ModelConfig(**SMOL, vocab_size=49152), 49152) == 134_515_008  # HF: 134.5M (tied head)


def test_a_model_directory_is_counted_from_its_config_json(tmp_path):
    text = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    text |= {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000}
    text |= {"tie_word_embeddings": False, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(text))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # present; the count never reads it
    got = model_params(ModelConfig(path=str(tmp_path)))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert got == 2 * 1000 * 64 + 2 * per_layer + 64


def test_choice_by_size_and_refusal():
    assert choose(10_000_000, 50_000_000, None).backend == "embedded"
    assert choose(10_000_000, 50_000_000, "no vLLM environment").backend == "embedded"
    big = choose(135_000_000, 50_000_000, None)
    assert big.backend == "vllm" and "135.0M" in big.line()
    refused = choose(135_000_000, 50_000_000, "no vLLM environment (x does not exist)")
    assert refused.backend == "embedded" and "no vLLM environment" in refused.reason


def _cfg(tmp_path, *overrides):
    pairs = [("inference.backend", "auto"), ("output_dir", str(tmp_path / "run")), *overrides]
    return load_run_config([TINY], pairs)


def test_tiny_model_stays_embedded(tmp_path):
    cfg = _cfg(tmp_path)
    choice = resolve_auto(cfg, vision=False)
    assert choice is not None and choice.backend == "embedded" and cfg.inference.backend == "embedded"
    assert choice.params < cfg.inference.auto_vllm_min_params


def test_above_the_threshold_vllm_needs_its_environment_and_its_capabilities(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    low = ("inference.auto_vllm_min_params", "1")
    missing = _cfg(tmp_path, low, ("inference.vllm.python", str(tmp_path / "absent")))
    assert resolve_auto(missing, False).backend == "embedded"
    present = _cfg(tmp_path, low, ("inference.vllm.python", str(python)))
    assert resolve_auto(present, False).backend == "vllm" and present.inference.backend == "vllm"
    collective = _cfg(tmp_path, low, ("inference.vllm.python", str(python)), ("weight_broadcast.type", "collective"))
    choice = resolve_auto(collective, False)
    assert choice.backend == "embedded" and "collective" in choice.reason  # never a backend that would be refused
    assert resolve_auto(_cfg(tmp_path, ("inference.backend", "embedded")), False) is None


def test_a_resume_keeps_the_stored_choice(tmp_path):
    cfg = _cfg(tmp_path)
    resolve_auto(cfg, False)
    assert keep_stored(cfg, {"inference": {"backend": "vllm"}}) is not None and cfg.inference.backend == "vllm"
    named = _cfg(tmp_path, ("inference.backend", "embedded"))
    assert keep_stored(named, {"inference": {"backend": "vllm"}}) is None and named.inference.backend == "embedded"


def test_the_cli_stores_the_choice_in_the_run_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    rc = main(["rl", "@", str(TINY), "--output-dir", str(out), "--inference.backend", "auto", "--dry-run"])
    assert rc == 0
    assert "inference.backend = \"auto\" chose 'embedded'" in capsys.readouterr().err
    for name in ("run", "inference"):
        stored = json.loads((out / "config" / f"{name}.json").read_text())
        assert stored["inference"]["backend"] == "embedded"
