"""Qwen3-MoE sparse block with routing record and router replay (R3).

Parameter names are Hugging Face's on-disk Qwen3-MoE names (what `Qwen3MoeForCausalLM.save_pretrained`
writes and `from_pretrained` reads): `mlp.gate.weight` [experts, hidden] and one
`mlp.experts.{i}.{gate,up,down}_proj.weight` per expert (transformers fuses the experts in memory only).

Forward, as transformers does it: router logits -> softmax (fp32) -> top-k -> optionally renormalise the
k weights (`norm_topk_prob`) -> weighted sum of the chosen experts' SwiGLU outputs.

A `Routing` passed through the model's forward carries the per-layer traffic:
- `replay` [B, T, layers, k] expert ids chosen elsewhere (the sampler); -1 at a position means "route
  afresh". Replayed positions use the given ids and recompute only their gate weights (softmax over this
  model's router logits, gathered at those ids, renormalised as the model does), so gradients still
  reach the router.
- `fresh` collects, per MoE layer in model order, the [B, T, k] ids this model's own router picked (with
  or without replay): generation stores them as the routing payload; the trainer compares them with the
  sampler's to count routing disagreements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from config.model import ModelConfig


@dataclass
class Routing:
    replay: torch.Tensor | None = None  # [B, T, layers, k] int64, -1 = route afresh
    fresh: list[torch.Tensor] = field(default_factory=list)  # per MoE layer: [B, T, k] int64

    def stacked(self) -> torch.Tensor:
        """The recorded ids as one [B, T, layers, k] tensor."""
        return torch.stack(self.fresh, dim=2)


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """`forward(x [B, T, H], routing) -> [B, T, H]`; `index` is this block's position among MoE layers."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool, index: int):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.index = top_k, norm_topk_prob, index
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, intermediate) for _ in range(num_experts)])
        # Under expert parallelism: the all-to-all that runs the chosen experts on the ranks holding them
        # (engines/trainer/expert_parallel.py); None runs them all here.
        self.exchange: Callable[[SparseMoeBlock, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Data-parallel (FSDP2) ranks: every expert runs, on no token too, so every rank reduces the same
        # gradients; `routed` counts each expert's tokens (here, or in EP's exchange) until the trainer drops
        # the gradients of those no rank routed to (engines/trainer/expert_parallel.py `drop_unrouted_grads`),
        # as one process would never have made them.
        self.every_expert = False
        self.routed = torch.zeros(num_experts, dtype=torch.int64)

    def route(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert ids used [N, k], their gate weights [N, k] in x's dtype, this router's own top-k ids [N, k])
        for flattened tokens x [N, H]; `replay` [N, k] forces ids where it is >= 0."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, own = torch.topk(probs, self.top_k, dim=-1)
        ids = own
        if replay is not None:
            ids = torch.where(replay >= 0, replay, own)
            weights = probs.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype), own

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        replay = None
        if routing is not None and routing.replay is not None:
            replay = routing.replay[:, :, self.index].reshape(-1, self.top_k)
        ids, weights, own = self.route(flat, replay)
        if routing is not None:
            routing.fresh.append(own.view(b, t, self.top_k))
        if self.exchange is not None:
            return self.exchange(self, flat, ids, weights).view(b, t, h)
        out = torch.zeros_like(flat)
        experts = torch.unique(ids).tolist()
        if self.every_expert and torch.is_grad_enabled():  # (a forward without backward needs neither)
            self.routed += torch.bincount(ids.reshape(-1).cpu(), minlength=len(self.experts))
            experts = list(range(len(self.experts)))
        for e in experts:
            token, slot = torch.where(ids == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(b, t, h)


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    """Qwen3-MoE's rule: experts unless the layer is listed dense or off the `decoder_sparse_step` grid."""
    return bool(cfg.num_experts) and layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0


def build_sparse_mlp(cfg: ModelConfig, index: int) -> SparseMoeBlock:
    """The sparse block of the `index`-th MoE layer."""
    width = cfg.moe_intermediate_size or cfg.intermediate_size
    return SparseMoeBlock(cfg.hidden_size, width, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, index)
