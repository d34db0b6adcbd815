"""engines/trainer/flops.py: a step's FLOPs counted from the model's shapes, and the matmul peak measurement."""

from __future__ import annotations

import torch
from torch import nn

from config.model import LoRAConfig, ModelConfig
from engines.models import lora
from engines.models.decoder import CausalLM
from engines.trainer import flops

SHAPE = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def _model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**SHAPE, max_seq_len=64), 50)


def test_step_flops_counts_linear_parameters_and_attention_from_the_shapes():
    model = _model()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    # by hand: q 32x32, k and v 32x16 each, o 32x32, mlp 3 x 32x64, per layer; the lm_head 32x50 (untied)
    assert linear == 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 50
    attention = 3 * 2 * 2 * 2 * 10 * (4 * 8) / 2  # layers 2, sequence 10, width heads x head_dim = 32
    assert flops.step_flops(model, 100, 10) == 100 * (6 * linear + attention)


def test_step_flops_under_lora_trains_only_the_adapters_weight_gradients():
    model = _model()
    full = flops.step_flops(model, 1, 0)
    lora.attach_to(model, LoRAConfig(rank=2, target_modules=["q_proj"]), train=True)
    adapters = 2 * (2 * 32 + 32 * 2)  # two layers' q_proj: A [2, 32] and B [32, 2]
    # the base weights still cost forward and activation-gradient FLOPs (4N); their weight gradients (2N) go
    assert flops.step_flops(model, 1, 0) == 4 * (full / 6) + 6 * adapters


def test_matmul_peak_is_a_plausible_rate():
    peak = flops.matmul_peak({(16, 16), (64, 64)}, 64, torch.float32, min_s=0.01)
    # any CPU runs fp32 matmuls between 0.1 GFLOP/s and 10 TFLOP/s a core or two: a count off by 1000x lands outside
    assert 1e8 < peak < 1e13
