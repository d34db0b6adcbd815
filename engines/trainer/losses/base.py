"""The policy-loss interface every variant implements, built-in or brought by a plugin.

A variant is a `LossSpec`: a function from `LossInputs` (one micro-batch's per-token logprobs of the
trainer, the sampler and the proximal policy, advantages, the mask of tokens to train, and which sample
each token belongs to) and its typed parameters to `LossTerms` (a loss term per token, and what it did to
each token: its ratio, whether it was dropped or clipped). The trainer (engines/trainer/losses/objective.py)
aggregates the terms into the step's loss (token mean, sequence mean or a constant), adds the entropy and
reference-KL terms, and turns the rest into the step's metrics, so a variant is only its formula.

Inputs are sanitised before a variant sees them: `mask` holds only completion tokens with a finite sampler
logprob, and off-mask positions carry finite stand-ins, so a variant never meets NaN or -inf; it must still
keep its terms exactly 0 off the mask and finite when a log ratio is huge (exponentiate only what it keeps,
or clamp first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [R, T] the trainer's logprob of each sampled token, with gradient
    sampler_logprobs: torch.Tensor  # [R, T] the behaviour policy's (the sampler's), no gradient
    proximal_logprobs: torch.Tensor  # [R, T] the trainer's policy at the step's start (= logprobs.detach() at first)
    advantages: torch.Tensor  # [R, T] each token's sample advantage
    mask: torch.Tensor  # [R, T] bool: the tokens to train on
    sequence: torch.Tensor  # [R, T] long: the sample (0 .. n_sequences - 1) each token belongs to, -1 elsewhere
    n_sequences: int

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """[n_sequences]: the sum of `values` over each sample's masked tokens."""
        index = torch.where(self.mask, self.sequence, 0).flatten()
        kept = torch.where(self.mask, values, torch.zeros_like(values)).flatten()
        return torch.zeros(self.n_sequences, dtype=values.dtype, device=values.device).index_add(0, index, kept)

    def sequence_mean(self, values: torch.Tensor) -> torch.Tensor:
        """[n_sequences]: the mean of `values` over each sample's masked tokens (0 for a sample with none)."""
        return self.sequence_sum(values) / self.sequence_sum(torch.ones_like(values)).clamp(min=1)

    def per_token(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[R, T]: each masked token gets its sample's value; 0 elsewhere."""
        spread = per_sequence[self.sequence.clamp(min=0)]
        return torch.where(self.mask, spread, torch.zeros_like(spread))


@dataclass
class LossTerms:
    per_token: torch.Tensor  # [R, T] loss terms, exactly 0 off the mask; the trainer aggregates them
    ratio: torch.Tensor  # [R, T] the importance ratio the variant weighed with (statistics only)
    dropped: torch.Tensor  # [R, T] bool: masked tokens the variant gave no gradient
    clipped: torch.Tensor  # [R, T] bool: masked tokens whose ratio the variant clipped or truncated
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # [R, T] each, token-averaged over the mask


LossFn = Callable[[LossInputs, Any], LossTerms]


@dataclass(frozen=True)
class LossSpec:
    """What a `rollflow.losses` entry point (or an import path) names."""

    fn: LossFn
    params: type[BaseModel]  # validates the profile's parameters (a plugin's `args`)
    sequence_level: bool = False  # reads whole samples: refused where context parallelism splits them
    uses_proximal: Callable[[Any], bool] = lambda params: False  # reads proximal_logprobs with these parameters


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask`, exactly 0 elsewhere (no NaN leaks through a multiplication by 0)."""
    return torch.where(mask, values, torch.zeros_like(values))


def exp_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, limit: float = 60.0) -> torch.Tensor:
    """exp(log_ratio) on the mask with the log ratio clamped to +-limit (finite in float32), 1 elsewhere."""
    return torch.exp(masked(log_ratio, mask).clamp(-limit, limit))
