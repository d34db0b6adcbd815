"""Setup pieces shared by the warm-up and the RL loop."""

from __future__ import annotations

import logging
import random
from typing import NamedTuple

import torch

from engines.models.decoder import CausalLM, token_logprobs
from engines.models.moe import Routing
from engines.trainer.batch import Batch, PackedBatch

log = logging.getLogger("rollflow.trainer")


def seed_everything(seed: int, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    random.seed(seed)


def batch_logprobs(model: CausalLM, batch: Batch, routing: Routing | None = None) -> torch.Tensor:
    """Trainer logprobs of every target token under the per-sample sampling temperature, [B, T-1]."""
    logits = model(batch.input_ids, routing=routing)[:, :-1]
    return token_logprobs(logits, batch.targets, batch.temperatures)


def packed_logprobs(model: CausalLM, batch: PackedBatch, routing: Routing | None = None) -> torch.Tensor:
    """Trainer logprobs of every target of a packed batch, [R, L]; equal to `batch_logprobs` per sample."""
    logits = model(batch.input_ids, batch.positions, batch.attention_mask(), routing=routing)
    logp = torch.log_softmax(logits.float() / batch.temperatures[..., None], dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def train_logprobs(model: CausalLM, batch: Batch | PackedBatch, routing: Routing | None = None) -> torch.Tensor:
    """Logprobs for the loss, whichever layout the trainer chose (`trainer.packing`)."""
    if isinstance(batch, PackedBatch):
        return packed_logprobs(model, batch, routing)
    return batch_logprobs(model, batch, routing)


class Scored(NamedTuple):
    logprobs: torch.Tensor  # [rows, T] of each target token
    entropy: torch.Tensor | None  # [rows, T] of the distribution each target was drawn from; None unless asked


def scored_tokens(
    model: CausalLM, batch: Batch | PackedBatch, routing: Routing | None = None, entropy: bool = False
) -> Scored:
    """Logprobs (and with `entropy` the entropy) of every target, whichever layout the trainer chose."""
    if isinstance(batch, PackedBatch):
        logits = model(batch.input_ids, batch.positions, batch.attention_mask(), routing=routing)
        temps = batch.temperatures[..., None]
    else:
        logits = model(batch.input_ids, routing=routing)[:, :-1]
        temps = batch.temperatures.view(-1, 1, 1)
    logp = torch.log_softmax(logits.float() / temps, dim=-1)
    chosen = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    return Scored(chosen, -(logp.exp() * logp).sum(-1) if entropy else None)


def routing_for(batch: Batch | PackedBatch, replay: bool) -> Routing | None:
    """Router replay (R3) of the sampler's expert ids when asked and the batch carries them; otherwise a
    plain record of the trainer's own routing (MoE batches only), for counting disagreements."""
    if batch.routes is None:
        return None
    return Routing(replay=batch.routes if replay else None)


def expert_disagreement(routing: Routing | None, batch: Batch | PackedBatch) -> tuple[float, float]:
    """(scored tokens whose top-k expert set differs from the sampler's in any layer, scored tokens).

    Compares the trainer's own router choice (recorded even while replaying) with the sampler's, at the
    positions whose logits score a completion token (`loss_mask`)."""
    if routing is None or batch.routes is None or not routing.fresh:
        return 0.0, 0.0
    mine = routing.stacked().sort(-1).values
    theirs = batch.routes.sort(-1).values
    scored = batch.loss_mask > 0
    if isinstance(batch, Batch):  # loss_mask is [B, T-1]: position t scores target t
        mine, theirs = mine[:, :-1], theirs[:, :-1]
    scored = scored & (theirs[..., 0, 0] >= 0)  # positions the sampler's payload covers
    differs = (mine != theirs).flatten(2).any(-1)
    return float((differs & scored).sum()), float(scored.sum())
