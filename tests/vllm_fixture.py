"""A run directory whose publications are Hugging Face directories, for the vLLM backend's tests.

Built offline from rollflow's own model (random weights, Llama naming) and its character tokenizer saved in
HF format; each publication is committed like the trainer's, plus config.json and the tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

from config.model import ModelConfig


def hf_config(mc: ModelConfig, vocab_size: int, tok) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_key_value_heads": mc.num_kv_heads,
        "max_position_embeddings": mc.max_seq_len,
        "rope_theta": mc.rope_theta,
        "rms_norm_eps": mc.rms_norm_eps,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
    }


def hf_files(mc: ModelConfig, tmp: Path) -> dict[str, bytes]:
    """config.json + the tokenizer files of a publication."""
    from engines.tokenizer import CharTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp / "tok")
    files = {p.name: p.read_bytes() for p in (tmp / "tok").iterdir()}
    files["config.json"] = json.dumps(hf_config(mc, tok.vocab_size, tok)).encode()
    return files


def publish_hf(output_dir: Path, version: int, model, mc: ModelConfig, tmp: Path) -> str:
    """Commit `model`'s weights as publication `version` with the HF files beside them."""
    from safetensors.torch import save

    from storage import weights
    from storage.fs import commit_dir, get_fs, sha256

    fs, root = get_fs(str(output_dir))
    full = save({k: v.contiguous() for k, v in model.publishable_state_dict().items()})
    directory = weights.version_dir(root, version)
    meta = {"version": version, "model_sha256": sha256(full), "full_bytes": len(full)}
    commit_dir(fs, directory, {weights.WEIGHTS_FILE: full, **hf_files(mc, tmp)}, meta)
    return directory
