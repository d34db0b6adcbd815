"""`model.impl = "hf"`: transformers' own modeling behind rollflow's model interface.

`HFCausalLM.forward(ids, positions, mask, cache) -> logits` is what the trainer (padded or packed
batches: position ids and a 4-D boolean mask) and the embedded engine (left-padded prefill, cached
decode) call on `engines.models.decoder.CausalLM`; here it goes to `AutoModelForCausalLM` with the same position
ids and mask, and the cache is transformers' `DynamicCache`. Publications use the transformers module's
own state dict, whose names are the family's Hugging Face names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from config.model import ModelConfig
from engines.models.decoder import Publishable
from engines.models.moe import Routing


class HFCache:
    """A `DynamicCache` with the two things `engines.inference.embedded.generate` uses: `length` and `select_rows`."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.length = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.reorder_cache(rows)  # index_select on every layer's keys and values

    def _layers(self) -> list[Any]:
        layers = self.inner.layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise NotImplementedError("joining a running batch needs full-attention cache layers, not sliding ones")
        return layers

    def realign(self, front: int, capacity: int) -> None:
        """Shift the cached slots by `front` (as `KVCache.realign`; the cache grows itself, so no capacity)."""
        for layer in self._layers():
            if front >= 0:
                layer.keys, layer.values = (
                    torch.nn.functional.pad(t, (0, 0, front, 0)) for t in (layer.keys, layer.values)
                )
            else:
                layer.keys, layer.values = layer.keys[:, :, -front:], layer.values[:, :, -front:]
        self.length += front

    def extend(self, other: HFCache) -> None:
        assert other.length == self.length, (other.length, self.length)
        for a, b in zip(self._layers(), other._layers(), strict=True):
            a.keys, a.values = torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values])


class HFCausalLM(Publishable, nn.Module):
    hf: Any  # a transformers PreTrainedModel

    def __init__(self, hf_model: Any, cfg: ModelConfig, vocab_size: int | None = None):
        super().__init__()
        self.hf = hf_model
        self.cfg = cfg
        self.vocab_size = int(vocab_size or hf_model.config.vocab_size)

    def weights_module(self) -> nn.Module:
        return self.hf

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: HFCache | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        if routing is not None:
            raise NotImplementedError(
                "routing payloads and router replay need rollflow's own MoE code: set model.impl = 'custom' "
                "(or 'auto'), or turn off inference.enable_return_routed_experts and trainer.enable_router_replay"
            )
        out = self.hf(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache.inner if cache is not None else None,
            use_cache=cache is not None,
        )
        if cache is not None:
            cache.length += input_ids.shape[1]
        return out.logits

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype) -> HFCache:
        from transformers import DynamicCache

        return HFCache(DynamicCache(config=self.hf.config))


def from_directory(directory: str, cfg: ModelConfig, pretrained: bool) -> HFCausalLM:
    """transformers' model of a Hugging Face directory in float32: its weights when `pretrained`, else
    freshly initialised (the caller loads a publication next)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if pretrained:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    else:
        config = AutoConfig.from_pretrained(directory)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return HFCausalLM(model, cfg)
