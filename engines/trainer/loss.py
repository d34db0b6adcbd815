"""Importance-weighted policy-gradient loss with trust-region token masking (docs/algorithm.md).

For completion token t of sample i, with trainer logprob l = log pi_theta and sampler logprob m:
    r = exp(l - m)                      importance ratio against the policy that sampled the token
    keep = 1[mask_low <= r <= mask_high] (r taken without gradient)
    loss = -sum_{i,t} keep * r * A_i / N_tokens
so the gradient is keep * r * A_i * grad(l): REINFORCE with a group baseline, importance-corrected for
stale or mismatched samples, with tokens outside the trust region dropped instead of clipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    masked_tokens: float  # tokens dropped by the trust region
    tokens: float  # completion tokens in this micro-batch
    sampler_kl_sum: float  # sum over tokens of k3(r) = r - 1 - log r, KL(sampler || trainer) estimate


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    mask_low: float,
    mask_high: float,
    normalizer: float,
) -> LossOutput:
    """All [B, T]; advantages [B] (one per sample) or [B, T] (per token, packed batches); `normalizer` is
    the step's total completion tokens."""
    ratio = torch.exp((logprobs - sampler_logprobs) * loss_mask)
    with torch.no_grad():
        keep = loss_mask * ((ratio >= mask_low) & (ratio <= mask_high))
        kl_sum, tokens = k3_kl(logprobs, sampler_logprobs, loss_mask)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    loss = -(ratio * adv * keep).sum() / normalizer
    return LossOutput(loss=loss, masked_tokens=float((loss_mask - keep).sum()), tokens=tokens, sampler_kl_sum=kl_sum)


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum of k3 estimates of KL(reference || policy), token count) over masked positions."""
    log_ratio = (logprobs - reference_logprobs) * mask
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    return float(k3.sum()), float(mask.sum())
