"""Importance-weighted policy-gradient loss with trust-region token masking (docs/algorithm.md).

For completion token t of sample i, with trainer logprob l = log pi_theta and sampler logprob m:
    r = exp(l - m)                      importance ratio against the policy that sampled the token
    keep = 1[mask_low <= r <= mask_high] (r taken without gradient)
    loss = -sum_{i,t} keep * r * A_i / N_tokens
so the gradient is keep * r * A_i * grad(l): REINFORCE with a group baseline, importance-corrected for
stale or mismatched samples, with tokens outside the trust region dropped instead of clipped.

A dropped token contributes exactly zero loss and zero gradient whatever its ratio: the ratio is
exponentiated only where it is kept, so an overflowing ratio (a log ratio of 100, or a sampler logprob
of -inf, which external engines can return) never makes `inf * 0 = NaN`. Tokens whose sampler logprob
is not finite are dropped and counted (`nonfinite_tokens`), never trained on.
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
    nonfinite_tokens: float  # completion tokens whose sampler logprob was NaN or +-inf (dropped)


# k3 of a log ratio beyond this is clamped (as verl does), so one wild token cannot make the KL infinite.
KL_LOG_RATIO_CLAMP = 20.0


def finite_log_ratio(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ratio l - m, zero where not counted; the mask of counted tokens: in `mask` with a finite m)."""
    valid = (mask > 0) & torch.isfinite(sampler_logprobs)
    safe = torch.where(valid, sampler_logprobs, torch.zeros_like(sampler_logprobs))
    return torch.where(valid, logprobs - safe, torch.zeros_like(logprobs)), valid


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
    log_ratio, valid = finite_log_ratio(logprobs, sampler_logprobs, loss_mask)
    with torch.no_grad():
        r = torch.exp(log_ratio)
        keep = valid & (r >= mask_low) & (r <= mask_high)
        kl_sum, tokens = k3_kl(logprobs, sampler_logprobs, loss_mask)
    ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    loss = -(ratio * adv * keep).sum() / normalizer
    return LossOutput(
        loss=loss,
        masked_tokens=float((loss_mask - keep.to(loss_mask.dtype)).sum()),
        tokens=float(loss_mask.sum()),
        sampler_kl_sum=kl_sum,
        nonfinite_tokens=float(((loss_mask > 0) & ~torch.isfinite(sampler_logprobs)).sum()),
    )


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum of k3 estimates of KL(reference || policy), token count) over masked positions whose
    reference logprob is finite; each log ratio is clamped to +-KL_LOG_RATIO_CLAMP so the sum stays finite."""
    log_ratio, valid = finite_log_ratio(logprobs, reference_logprobs, mask)
    log_ratio = log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * valid
    return float(k3.sum()), float(valid.sum())
