"""Setup pieces shared by the warm-up and the RL loop."""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from typing import NamedTuple, cast

import torch

from engines.models.decoder import CausalLM, token_logprobs
from engines.models.moe import Routing
from engines.models.vlm import HFVisionLM, is_vision
from engines.trainer.batch import Batch, PackedBatch

log = logging.getLogger("rollflow.trainer")


def seed_everything(seed: int, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    random.seed(seed)


@contextlib.contextmanager
def bf16_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Within: every parameter and floating-point buffer of `model` reads as its bfloat16 cast (tied ones stay tied),
    so a forward computes as `model.to(torch.bfloat16)` would, which is how the engine serves `inference.dtype =
    "bfloat16"`, while autograd carries the gradients back to the float32 parameters (FSDP's
    `MixedPrecisionPolicy(param_dtype=bfloat16)` for one process). Backward may run after the block: the graph
    holds the casts."""
    swapped: list[tuple[torch.nn.Module, str, torch.Tensor, bool | None]] = []  # persistent: None for parameters
    casts: dict[int, torch.Tensor] = {}
    try:
        for module in model.modules():
            hidden = module._non_persistent_buffers_set  # buffers left out of state_dict (RoPE's inv_freq)
            tensors: list[tuple[str, torch.Tensor, bool | None]] = [
                (n, t, None) for n, t in module.named_parameters(recurse=False)
            ]
            tensors += [
                (n, t, n not in hidden) for n, t in module.named_buffers(recurse=False) if t.is_floating_point()
            ]
            for name, t, persistent in tensors:
                low = casts.setdefault(id(t), t.to(torch.bfloat16))
                delattr(module, name)
                setattr(module, name, low)  # a plain attribute while the original is out
                swapped.append((module, name, t, persistent))
        yield
    finally:
        for module, name, t, persistent in swapped:  # in order: parameters() and state_dict() keep theirs
            delattr(module, name)
            if persistent is None:
                module.register_parameter(name, cast(torch.nn.Parameter, t))
            else:
                module.register_buffer(name, t, persistent=persistent)


def forward_precision(model: torch.nn.Module, compute_dtype: str) -> contextlib.AbstractContextManager[None]:
    """The context of a trainer forward of `model` in `trainer.compute_dtype`: `bf16_parameters` for bfloat16,
    else a no-op."""
    return bf16_parameters(model) if compute_dtype == "bfloat16" else contextlib.nullcontext()


def padded_logits(model: CausalLM, batch: Batch, routing: Routing | None = None) -> torch.Tensor:
    """[B, T, V] logits of right-padded rows. A vision-language model gets the rows' multimodal positions (every
    token counted valid: the padding follows a row's tokens, so it moves none of their positions, and the causal
    mask keeps it out of their attention) and the micro-batch's images, and its logits are those of the
    distribution the engine samples from (`HFVisionLM.sampled_logits`: the image token never)."""
    if not is_vision(model):
        return model(batch.input_ids, routing=routing)
    vlm = cast(HFVisionLM, model)
    images = batch.vision()
    positions = vlm.mrope_positions(batch.input_ids, torch.ones_like(batch.input_ids, dtype=torch.bool), images)
    return vlm.sampled_logits(vlm(batch.input_ids, positions, routing=routing, vision=images))


def batch_logprobs(model: CausalLM, batch: Batch, routing: Routing | None = None) -> torch.Tensor:
    """Trainer logprobs of every target token under the per-sample sampling temperature, [B, T-1]."""
    logits = padded_logits(model, batch, routing)[:, :-1]
    return token_logprobs(logits, batch.targets, batch.temperatures)


def packed_logprobs(model: CausalLM, batch: PackedBatch, routing: Routing | None = None) -> torch.Tensor:
    """Trainer logprobs of every target of a packed batch, [R, L]; equal to `batch_logprobs` per sample."""
    logits = model(batch.input_ids, batch.positions, batch.attention_mask(), routing=routing)
    logp = torch.log_softmax(logits.float() / batch.temperatures[..., None], dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


class Scored(NamedTuple):
    """What the trainer's forward gives per target (read the fields by name)."""

    logprobs: torch.Tensor  # [B, T-1] / [R, L]
    entropy: torch.Tensor | None  # same shape: entropy of the distribution each logprob is taken from; if asked
    # targets with a kept support whose sampled token the trainer ranks outside its own top k (a near tie at
    # the boundary under other numerics): scored on the trainer's top k-1 plus that token instead
    support_mismatch_tokens: int = 0


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def restricted_logprobs(
    scaled: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor, entropy: bool = False
) -> Scored:
    """Log-probability of each target under softmax(`scaled`) restricted to its sampler's kept support.

    `scaled` [..., V] are temperature-scaled logits, `kept` [...] the number of most likely tokens the sampler
    kept (top-k / top-p truncation; 0 or >= V: the full vocabulary). With z sorted descending and k kept:
    logprob = z[y] - logcumsumexp(z)[k-1]. When the trainer ranks y outside its top k (more than k-1 tokens
    score strictly higher), the support is the top k-1 plus y: logZ = logaddexp(logcumsumexp(z)[k-2], z[y])
    (k = 1: logprob 0). Full-vocabulary positions get exactly `log_softmax(scaled)`'s value.
    """
    vocab = scaled.shape[-1]
    k = torch.where(kept >= vocab, 0, kept).long()
    full = torch.log_softmax(scaled, dim=-1)
    lp_full = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not bool((k > 0).any()):
        return Scored(lp_full, _entropy(full) if entropy else None)
    ordered = scaled.sort(dim=-1, descending=True).values
    cumulative = torch.logcumsumexp(ordered, dim=-1)
    kk = torch.where(k > 0, k, vocab)
    zy = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    inside = (scaled > zy.unsqueeze(-1)).sum(-1) < kk
    logz_in = cumulative.gather(-1, (kk - 1).unsqueeze(-1)).squeeze(-1)
    above = cumulative.gather(-1, (kk - 2).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logz_out = torch.where(kk >= 2, torch.logaddexp(above, zy), zy)
    logz = torch.where(inside, logz_in, logz_out)
    restricted = k > 0
    logprobs = torch.where(restricted, zy - logz, lp_full)
    ent = None
    if entropy:
        rank = torch.arange(vocab, device=scaled.device)
        width = torch.where(inside, kk, kk - 1)  # sorted positions in the support (y added apart when outside)
        lps = (ordered - logz.unsqueeze(-1)).clamp(max=0)  # <= 0 on the support
        terms = torch.where(rank < width.unsqueeze(-1), lps.exp() * lps, torch.zeros_like(lps)).sum(-1)
        lpy = (zy - logz).clamp(max=0)
        terms = terms + torch.where(inside, torch.zeros_like(lpy), lpy.exp() * lpy)
        ent = torch.where(restricted, -terms, _entropy(full))
    return Scored(logprobs, ent, int((restricted & ~inside).sum()))


def scored_tokens(
    model: CausalLM,
    batch: Batch | PackedBatch,
    routing: Routing | None = None,
    keep_support: bool = True,
    entropy: bool = False,
) -> Scored:
    """The trainer's logprob of every target, whichever layout the trainer chose (`trainer.packing`): on the
    support the sampler's truncation kept where the batch records one (`batch.kept` > 0, with `keep_support`),
    else on the full vocabulary, bit for bit `batch_logprobs` / `packed_logprobs`; and with `entropy` the
    entropy of the same distribution per position."""
    kept = batch.kept if keep_support else None
    restrict = kept is not None and bool((kept > 0).any())
    if not restrict and not entropy:  # the plain path: nothing sorts, nothing slows down without truncation
        if isinstance(batch, PackedBatch):
            return Scored(packed_logprobs(model, batch, routing), None)
        return Scored(batch_logprobs(model, batch, routing), None)
    if isinstance(batch, PackedBatch):
        logits = model(batch.input_ids, batch.positions, batch.attention_mask(), routing=routing)
        scaled = logits.float() / batch.temperatures[..., None]
    else:
        logits = padded_logits(model, batch, routing)[:, :-1]
        scaled = logits.float() / batch.temperatures.view(-1, 1, 1)
    zeros = torch.zeros_like(batch.targets)
    return restricted_logprobs(scaled, batch.targets, kept if restrict and kept is not None else zeros, entropy)


def train_logprobs(model: CausalLM, batch: Batch | PackedBatch, routing: Routing | None = None) -> torch.Tensor:
    """Logprobs for the loss, whichever layout the trainer chose (`trainer.packing`), on the sampler's kept
    support where the batch records one (`scored_tokens`)."""
    return scored_tokens(model, batch, routing).logprobs


def routing_for(batch: Batch | PackedBatch, replay: bool) -> Routing | None:
    """Router replay (R3) of the sampler's expert ids when asked and the batch carries them; otherwise a
    plain record of the trainer's own routing (MoE batches only), for counting disagreements."""
    if batch.routes is None:
        return None
    return Routing(replay=batch.routes if replay else None)


def expert_disagreement(
    routing: Routing | None, batch: Batch | PackedBatch, mask: torch.Tensor | None = None
) -> tuple[float, float]:
    """(scored tokens whose top-k expert set differs from the sampler's in any layer, scored tokens).

    Compares the trainer's own router choice (recorded even while replaying) with the sampler's, at the
    positions whose logits score a completion token (`mask`, aligned with and by default `loss_mask`)."""
    if routing is None or batch.routes is None or not routing.fresh:
        return 0.0, 0.0
    mine = routing.stacked().sort(-1).values
    theirs = batch.routes.sort(-1).values
    scored = (batch.loss_mask if mask is None else mask) > 0
    if isinstance(batch, Batch):  # loss_mask is [B, T-1]: position t scores target t
        mine, theirs = mine[:, :-1], theirs[:, :-1]
    scored = scored & (theirs[..., 0, 0] >= 0)  # positions the sampler's payload covers
    differs = (mine != theirs).flatten(2).any(-1)
    return float((differs & scored).sum()), float(scored.sum())
