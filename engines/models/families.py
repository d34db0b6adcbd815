"""Model families rollflow's own model code (engines/models/decoder.py) implements: the one registry.

A family maps a Hugging Face `config.json` (its `model_type`) to `ModelConfig` fields, says which
configs the custom code cannot run (then `impl = "auto"` falls back to transformers), and writes the
`config.json` of a publication back. Parameter names are the family's Hugging Face names, so weights
load by name in both directions.

Everything that resolves a family goes through `registered()`: `model.family` at load (config/model.py,
by name from installed metadata), a directory's config.json `model_type` (`unsupported`, `model_fields`,
picking `model.impl`), and a publication's config.json (`hf_config`). To add a family without editing
rollflow: define its `Family` in any package and register it as an entry point in the
`rollflow.model_families` group under its `model_type` (tests/plugins/pkg/toyfamilies is one; docs/models.md).
Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from config import registry as config_registry
from config.model import ModelConfig
from config.registry import MODEL_FAMILIES, MODEL_FAMILY_GROUP
from engines import registry


class UnsupportedConfig(ValueError):
    """A config.json the custom model code cannot run (the reason names the field)."""


@dataclass(frozen=True)
class Family:
    name: str  # config.json model_type
    architecture: str  # config.json architectures[0], the transformers class
    qk_norm: bool
    moe: bool = False
    # extra checks of a config.json beyond the shared ones: return a reason the custom code cannot run it
    check: Callable[[dict], str | None] = lambda hf: None
    extra_fields: dict[str, str] = field(default_factory=dict)  # config.json key -> ModelConfig field
    constants: dict[str, Any] = field(default_factory=dict)  # config.json keys a publication writes as given
    # why rollflow's own code cannot run any model of this family ("" when it can): only `impl = "hf"` runs it
    hf_only: str = ""


def registered() -> dict[str, Family]:
    """model_type -> Family: rollflow's own (config/registry.py MODEL_FAMILIES) and every installed package's
    entry point in the `rollflow.model_families` group."""
    names = config_registry.registered(MODEL_FAMILY_GROUP, MODEL_FAMILIES)
    return {name: _family(name, path) for name, path in names.items()}


def _family(name: str, path: str) -> Family:
    family = registry.import_object(path)
    if not isinstance(family, Family):
        raise registry.PluginError(
            f"model family {name!r} ({path}, entry-point group {MODEL_FAMILY_GROUP!r}) is a "
            f"{type(family).__name__}, not an engines.models.families.Family"
        )
    if family.name != name:
        raise registry.PluginError(
            f"model family {name!r} ({path}) is registered under another name than its model_type "
            f"{family.name!r}; register it as {family.name!r}"
        )
    return family


def get(name: str) -> Family:
    families = registered()
    if name not in families:
        raise UnsupportedConfig(
            f"model family {name!r} is not registered (registered: {', '.join(sorted(families))}); "
            "use model.impl = 'hf' to run it with transformers' own modeling"
        )
    return families[name]


# config.json key -> ModelConfig field, shared by every registered family.
SHARED_FIELDS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "attention_bias": "attention_bias",
}
MOE_FIELDS = {
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
}


def rope(hf: dict) -> tuple[str, float]:
    """(rope type, theta) from transformers 5 `rope_parameters` or the older `rope_scaling`/`rope_theta`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return kind, float(theta)


def _shared_check(hf: dict) -> str | None:
    kind, _ = rope(hf)
    if kind != "default":
        return f"rope type {kind!r} (only the default RoPE is implemented)"
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act={hf.get('hidden_act')!r} (only silu)"
    if hf.get("use_sliding_window"):
        return "use_sliding_window=true (sliding-window attention is not implemented)"
    if hf.get("mlp_bias"):
        return "mlp_bias=true"
    return None


def unsupported(hf: dict) -> str | None:
    """Why the custom code cannot run this config.json, or None when it can."""
    families = registered()
    family = families.get(str(hf.get("model_type")))
    if family is None:
        return f"model_type {hf.get('model_type')!r} is not a registered family ({', '.join(sorted(families))})"
    return family.hf_only or _shared_check(hf) or family.check(hf)


def model_fields(hf: dict) -> dict:
    """ModelConfig fields set by a config.json of a registered family."""
    family = get(str(hf.get("model_type")))
    out = {"family": family.name, "qk_norm": family.qk_norm}
    for key, name in {**SHARED_FIELDS, **family.extra_fields}.items():
        if hf.get(key) is not None:
            out[name] = hf[key]
    if family.moe and "num_experts" not in out and hf.get("num_local_experts") is not None:
        out["num_experts"] = hf["num_local_experts"]  # transformers 5 writes Qwen3-MoE's num_experts under this name
    out["num_kv_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    out["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    out["rope_theta"] = rope(hf)[1]
    return out


def hf_config(cfg: ModelConfig, vocab_size: int, special: dict[str, int | None]) -> dict:
    """The config.json of a publication of `cfg` (float32 weights), for transformers' from_pretrained.

    `special`: bos/eos/pad token ids of the run's tokenizer."""
    family = get(cfg.family_name)
    data = {
        "architectures": [family.architecture],
        "model_type": family.name,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "dtype": "float32",
        "bos_token_id": special.get("bos"),
        "eos_token_id": special.get("eos"),
        "pad_token_id": special.get("pad"),
    }
    for key, name in {**SHARED_FIELDS, **family.extra_fields}.items():
        data[key] = getattr(cfg, name)
    data["vocab_size"] = vocab_size
    data |= family.constants
    if family.moe:
        data["moe_intermediate_size"] = cfg.moe_intermediate_size or cfg.intermediate_size
    return data


def _llama_check(hf: dict) -> str | None:
    return "pretraining_tp > 1" if hf.get("pretraining_tp", 1) != 1 else None


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=False, check=_llama_check, constants={"mlp_bias": False})
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True)
# The sparse block itself lives with the MoE layer; this entry maps its config fields.
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True, extra_fields=MOE_FIELDS)
# Vision-language: transformers' modeling behind engines/models/vlm.py; its fields stay in the directory's config.json.
VISION_HF_ONLY = (
    "a vision-language model: rollflow's own model code has no vision encoder nor multimodal RoPE "
    "(model.impl = 'hf' runs it with transformers' modeling, engines/models/vlm.py)"
)
QWEN3_VL = Family("qwen3_vl", "Qwen3VLForConditionalGeneration", qk_norm=True, hf_only=VISION_HF_ONLY)
QWEN3_VL_MOE = Family(
    "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", qk_norm=True, moe=True, hf_only=VISION_HF_ONLY
)
