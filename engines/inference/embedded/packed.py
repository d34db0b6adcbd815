"""`inference.onednn_linear`: the engine's fp32 Linear layers through oneDNN with weights packed once.

    load_engine -> pack_linears(model): each plain fp32 `nn.Linear` gets a forward that multiplies with a copy of
    its weight reordered into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), then
    `mkldnn._linear_pointwise`; the copy is made again when the weight changes (a weight update writes the
    parameters in place, which bumps the tensor's version counter, or replaces them: a new data pointer).

Why: on this CPU, one thread, the decode step is matmul-bound, and torch's default fp32 matmul (MKL) is slower than
oneDNN's on prepacked weights at the engine's shapes (64 rows; most of all the 49,152-wide head of SmolLM2-135M),
which is what vLLM's CPU build runs. The results are not bit-identical to MKL's (another summation order: the
logprobs of a 135M model moved by ~3e-6 in benchmark 8's measurement), hence off by default. It costs a second copy
of the Linear weights in memory. LoRA and MoE expert layers are not plain `nn.Linear` and keep their own forward.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)
ROWS_HINT = 64  # the batch size oneDNN lays the packed weight out for (any row count works)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_forward(mod: nn.Linear):
    cache: dict = {}

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = mod.weight
        key = (w.data_ptr(), w._version)
        if cache.get("key") != key:  # first call, or the weights changed since the last packing
            cache["key"], cache["w"] = key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), cache["w"], mod.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def pack_linears(model: nn.Module) -> int:
    """Route every plain fp32 `nn.Linear` of `model` through oneDNN; returns how many (0 without oneDNN)."""
    if not available():
        log.warning("inference.onednn_linear: this torch build has no oneDNN linear; MKL serves the model")
        return 0
    count = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.weight.dtype == torch.float32:
            mod.forward = _packed_forward(mod)  # type: ignore[method-assign]
            count += 1
    return count
