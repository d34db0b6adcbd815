"""rollflow's own policy-loss variants (docs/algorithm.md has each formula, its source and parameters).

Each is a `LossSpec` whose parameters are its model in config/loss.py. Notation per token: l the trainer's
logprob (with gradient), m the sampler's, p the proximal policy's (the trainer's at the step's start),
A the advantage, sg() stop-gradient.
"""

from __future__ import annotations

import torch

from config import loss as cfg
from engines.trainer.losses.base import LossInputs, LossSpec, LossTerms, exp_log_ratio, masked


def masked_is(x: LossInputs, p: cfg.MaskedISLoss) -> LossTerms:
    """r = exp(l - m); keep = mask_low <= sg(r) <= mask_high; term = -keep * r * A."""
    log_ratio = x.logprobs - x.sampler_logprobs
    with torch.no_grad():
        r = exp_log_ratio(log_ratio, x.mask)
        keep = x.mask & (r >= p.mask_low) & (r <= p.mask_high)
    ratio = torch.exp(masked(log_ratio, keep))  # exponentiated only where kept: never inf * 0
    return LossTerms(
        per_token=masked(-ratio * x.advantages, keep),
        ratio=r,
        dropped=x.mask & ~keep,
        clipped=torch.zeros_like(keep),
    )


MASKED_IS = LossSpec(fn=masked_is, params=cfg.MaskedISLoss)
