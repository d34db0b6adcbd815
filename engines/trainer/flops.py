"""A trainer step's FLOPs and this CPU's measured matmul peak, for MFU (model FLOPs utilisation).

`step_flops` counts the matmuls of a step from the model's own shapes: per token, forward 2N, backward 2N for the
activations' gradients and 2N for the trainable weights' (all of them, or only the adapters under LoRA), over the
Linear layers (an embedding is a gather, not a matmul); plus causal attention, QK^T and AV: 2 x 2 x layers x
sequence length x width FLOPs forward per token, halved for causality, x3 with backward. `matmul_peak` times
`torch.mm` at the model's Linear shapes for the step's token count and keeps the best: the peak this CPU reaches on
these shapes with this dtype and thread count, measured rather than taken from a datasheet.
"""

from __future__ import annotations

import time

import torch
from torch import nn


def linear_shapes(model: nn.Module) -> set[tuple[int, int]]:
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}


def _linear_params(model: nn.Module, trainable: bool) -> int:
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear):
            continue
        w = m.weight
        if id(w) in seen or (trainable and not w.requires_grad):
            continue
        seen.add(id(w))
        total += w.numel()
    return total


def attention_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, query width = heads x head_dim) of a rollflow CausalLM or a Hugging Face model."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "num_layers"):
        return cfg.num_layers, cfg.num_heads * cfg.head_size
    hf = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    if hf is None:
        return 0, 0
    hf = getattr(hf, "text_config", hf)
    heads = hf.num_attention_heads
    return hf.num_hidden_layers, heads * (getattr(hf, "head_dim", None) or hf.hidden_size // heads)


def token_cost(model: nn.Module) -> tuple[float, float]:
    """Forward + backward FLOPs per token of the Linear layers, and of attention per token per attended key."""
    n_all, n_train = _linear_params(model, False), _linear_params(model, True)
    layers, width = attention_shape(model)
    return 4 * n_all + 2 * n_train, 3 * 2 * 2 * layers * width


def step_flops(model: nn.Module, tokens: int, seq_len: float) -> float:
    """FLOPs of forward + backward over `tokens` tokens in causal sequences of `seq_len` tokens (mean)."""
    linear, attention = token_cost(model)
    return tokens * (linear + attention * seq_len / 2)


def _flops_per_s(fn, flops: float, min_s: float) -> float:
    fn()  # the first call allocates and picks its kernel
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_s or reps < 2:
        fn()
        reps += 1
    return flops * reps / elapsed


def matmul_peak(shapes: set[tuple[int, int]], tokens: int, dtype: torch.dtype, min_s: float = 0.05) -> float:
    """Best FLOP/s of [tokens, k] x [k, n] over the Linear shapes (k, n), each timed for `min_s` seconds."""
    best = 0.0
    for k, n in sorted(shapes):
        a, b = torch.randn(tokens, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        best = max(best, _flops_per_s(lambda a=a, b=b: torch.mm(a, b), 2.0 * tokens * k * n, min_s))
    return best
