"""Adapter publications' layout: PEFT's file names and tensor names, and folding an adapter into its base.

An adapter publication holds `adapter_model.safetensors` with PEFT's names
(`base_model.model.<module>.lora_A.weight` [r, in], `...lora_B.weight` [out, r]) and PEFT's
`adapter_config.json` (`r`, `lora_alpha`, ...). In memory the adapter tensors carry the model's own
names (`<module>.lora_A.weight`), which is what the model's state dict holds next to the base weights.
"""

from __future__ import annotations

import json

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def to_peft(adapters: dict) -> dict:
    return {PEFT_PREFIX + k: v for k, v in adapters.items()}


def from_peft(tensors: dict) -> dict:
    bad = [k for k in tensors if not k.startswith(PEFT_PREFIX) or not is_adapter_key(k)]
    if bad:
        raise ValueError(f"not a LoRA adapter in PEFT layout: unexpected tensor names {bad[:3]}")
    return {k[len(PEFT_PREFIX) :]: v for k, v in tensors.items()}


def scaling(adapter_config: bytes) -> float:
    cfg = json.loads(adapter_config)
    return float(cfg["lora_alpha"]) / int(cfg["r"])


def merge(base: dict, adapters: dict, scale: float) -> dict:
    """A plain state dict: base weights with every adapter folded in (W + scale * B @ A)."""
    merged = dict(base)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        b = adapters[f"{module}.lora_B.weight"]
        w = merged[f"{module}.weight"]
        merged[f"{module}.weight"] = w + (b.float() @ a.float() * scale).to(w.dtype)
    return merged
