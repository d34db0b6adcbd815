"""The step's objective: a policy-loss variant's per-token terms, aggregated, plus the entropy bonus and the
reference-KL penalty, with the statistics every variant reports.

Per micro-batch the trainer hands `Objective.__call__` its tensors; the inputs are sanitised here (tokens
with a non-finite sampler logprob leave the mask and are counted), the variant computes its terms, and
each masked token t of sample i is weighed by the aggregation's weight w:
    token_mean:    w = 1 / N             N = the optimizer step's completion tokens
    sequence_mean: w = 1 / (|y_i| S)     S = the optimizer step's samples that have a completion token,
                                         |y_i| sample i's completion tokens
    constant:      w = 1 / (C S)         C = loss.constant_tokens (Dr. GRPO)
    loss = sum_t w_t (term_t + kl_coef k(l_t, l_ref_t) - entropy_coef H_t)
N and S are counted over the whole optimizer step (every micro-batch and rank), so accumulated micro-batch
gradients equal the full mini-batch's; a sample without completion tokens adds nothing and is not counted in S.
Tokens with a non-finite sampler logprob stay in N and |y_i| (counted) but get no term (no gradient); they
count as dropped (masked_fraction) and as sampler_nonfinite_tokens. The statistics are sums the trainer adds
over micro-batches and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from config.trainer import TrainerConfig
from engines.trainer.batch import Batch, PackedBatch, sample_index
from engines.trainer.losses.base import LossInputs, LossSpec, masked
from engines.trainer.losses.kl import k3_kl, reference_kl
from engines.trainer.losses.registry import resolve

# statistics whose step value is a maximum over micro-batches and ranks, not a sum
MAX_STATS = ("ratio_max", "neg_ratio_min")


@dataclass
class StepCounts:
    """What the aggregation divides by, counted over one whole optimizer step."""

    tokens: float
    sequences: float


@dataclass
class TokenScores:
    """One micro-batch's per-token tensors, [R, T] each."""

    logprobs: torch.Tensor  # with gradient
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float, 1.0 on completion tokens to train
    sequence: torch.Tensor  # long: sample index within the micro-batch, -1 elsewhere
    proximal_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def token_scores(
    mb: Batch | PackedBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None = None,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> TokenScores:
    """A (packed) micro-batch's tensors as the objective reads them, with the trainer's scores of it."""
    adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None].expand_as(mb.loss_mask)
    return TokenScores(
        logprobs=logprobs,
        sampler_logprobs=mb.sampler_logprobs,
        advantages=adv,
        loss_mask=mb.loss_mask,
        sequence=sample_index(mb),
        proximal_logprobs=proximal,
        reference_logprobs=reference,
        entropy=entropy,
    )


def counts_of(mb: Batch | PackedBatch) -> StepCounts:
    """The counts of `mb` taken as a whole optimizer step (tests and benchmarks; the trainer counts mini-batches):
    its completion tokens, and its samples that have at least one (as the trainer counts them)."""
    index = sample_index(mb)
    with_tokens = torch.unique(index[(mb.loss_mask > 0) & (index >= 0)])
    return StepCounts(float(mb.loss_mask.sum()), float(with_tokens.numel()))


class Objective:
    def __init__(self, tcfg: TrainerConfig):
        self.loss_cfg, self.ref = tcfg.loss, tcfg.reference
        self.spec: LossSpec
        self.spec, self.params = resolve(tcfg.loss)
        if self.spec.sequence_level and tcfg.parallel.cp > 1:
            raise SystemExit(
                f"trainer.loss.type = {tcfg.loss.type!r} reads whole samples, which context parallelism splits "
                f"(trainer.parallel.cp = {tcfg.parallel.cp}); use cp = 1"
            )
        self.needs_proximal = tcfg.optimizer_steps > 1 and self.spec.uses_proximal(self.params)
        self.needs_entropy = tcfg.loss.entropy_coef > 0

    def weights(self, s: TokenScores, mask: torch.Tensor, counts: StepCounts) -> torch.Tensor:
        """[R, T] each masked token's weight in the step's loss (the module docstring's w)."""
        agg = self.loss_cfg.aggregation
        if agg == "token_mean":
            return mask / max(counts.tokens, 1.0)
        if agg == "constant":
            assert self.loss_cfg.constant_tokens is not None
            return mask / (max(counts.sequences, 1.0) * self.loss_cfg.constant_tokens)
        n = int(s.sequence.max()) + 1 if s.sequence.numel() else 0
        index = torch.where(mask > 0, s.sequence, 0).flatten()
        lengths = torch.zeros(n, dtype=mask.dtype, device=mask.device).index_add(0, index, mask.flatten())
        per_token = lengths[s.sequence.clamp(min=0)].clamp(min=1)
        return mask / (per_token * max(counts.sequences, 1.0))

    def __call__(self, s: TokenScores, counts: StepCounts) -> tuple[torch.Tensor, dict[str, float]]:
        counted = s.loss_mask > 0
        valid = counted & torch.isfinite(s.sampler_logprobs)
        detached = s.logprobs.detach()
        inputs = LossInputs(
            logprobs=s.logprobs,
            sampler_logprobs=torch.where(valid, s.sampler_logprobs, detached),
            proximal_logprobs=detached if s.proximal_logprobs is None else s.proximal_logprobs,
            advantages=s.advantages,
            mask=valid,
            sequence=torch.where(counted, s.sequence, -1),
            n_sequences=int(s.sequence.max()) + 1 if s.sequence.numel() else 0,
        )
        terms = self.spec.fn(inputs, self.params)
        w = self.weights(s, s.loss_mask, counts)
        total = masked(terms.per_token, valid)
        stats = self._stats(s, valid, terms)
        if self.ref.enabled:
            assert s.reference_logprobs is not None
            kl = masked(reference_kl(s.logprobs, s.reference_logprobs, self.ref.estimator), counted)
            total = total + self.ref.kl_coef * kl
            stats["ref_kl_sum"] = float(kl.detach().sum())
        if self.needs_entropy:
            assert s.entropy is not None
            total = total - self.loss_cfg.entropy_coef * masked(s.entropy, counted)
        return (total * w).sum(), stats

    def _stats(self, s: TokenScores, valid: torch.Tensor, terms) -> dict[str, float]:
        """Sums over this micro-batch (ratio_max / neg_ratio_min: maxima) of what the step reports."""
        ratio = terms.ratio.detach()
        counted = s.loss_mask > 0
        kl_sum, _ = k3_kl(s.logprobs.detach(), s.sampler_logprobs, s.loss_mask)
        stats = {
            "tokens": float(s.loss_mask.sum()),
            "valid_tokens": float(valid.sum()),
            # given no gradient: dropped by the variant, or by a non-finite sampler logprob
            "dropped": float((terms.dropped & valid).sum() + (counted & ~valid).sum()),
            "clipped": float((terms.clipped & valid).sum()),
            "ratio_sum": float(masked(ratio, valid).sum()),
            "ratio_max": float(torch.where(valid, ratio, -torch.inf).max()) if valid.any() else -math.inf,
            "neg_ratio_min": float(torch.where(valid, -ratio, -torch.inf).max()) if valid.any() else -math.inf,
            "sampler_kl_sum": kl_sum,
            "nonfinite": float((counted & ~valid).sum()),
        }
        if s.entropy is not None:
            stats["entropy_sum"] = float(masked(s.entropy.detach(), s.loss_mask > 0).sum())
        for name, values in terms.metrics.items():
            stats[f"loss/{name}_sum"] = float(masked(values.detach(), valid).sum())
        return stats


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def step_metrics(stats: dict[str, float], passes: int) -> dict[str, float | None]:
    """The step's metrics from the statistics summed over every micro-batch, rank and optimizer step; `passes`
    is how often each token was seen (trainer.epochs), so sampler_nonfinite_tokens counts each token once."""
    valid = max(stats.get("valid_tokens", 0.0), 1.0)
    tokens = max(stats.get("tokens", 0.0), 1.0)
    out: dict[str, float | None] = {
        "masked_fraction": stats.get("dropped", 0.0) / tokens,
        "clipped_fraction": stats.get("clipped", 0.0) / tokens,
        "ratio_mean": stats.get("ratio_sum", 0.0) / valid,
        "ratio_max": _finite(stats.get("ratio_max", -math.inf)),  # None: no token was trained on
        "ratio_min": _finite(-stats.get("neg_ratio_min", -math.inf)),
        "sampler_kl": stats.get("sampler_kl_sum", 0.0) / tokens,
        "sampler_nonfinite_tokens": stats.get("nonfinite", 0.0) / passes,
        "entropy": stats["entropy_sum"] / tokens if "entropy_sum" in stats else None,
        "ref_kl": stats["ref_kl_sum"] / tokens if "ref_kl_sum" in stats else None,
    }
    for key, value in stats.items():
        if key.startswith("loss/"):
            out[key.removesuffix("_sum")] = value / valid
    return out
