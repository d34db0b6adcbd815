"""KL estimates between the trainer and another policy: the sampler (sampler_kl, mismatch_kl) or a frozen
reference (the reference penalty).

Schulman's estimators of KL(pi || ref) from tokens sampled by pi, with log ratio d = l_pi - l_ref:
k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (unbiased and >= 0). The sampler metrics use k3 of the
sampler-over-trainer ratio (KL(sampler || trainer) from the sampler's tokens).
"""

from __future__ import annotations

import torch

# A log ratio beyond this is clamped (as verl does), so one wild token cannot make a KL infinite.
KL_LOG_RATIO_CLAMP = 20.0


def finite_log_ratio(
    logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ratio l - m, zero where not counted; the mask of counted tokens: in `mask` with a finite m)."""
    valid = (mask > 0) & torch.isfinite(sampler_logprobs)
    safe = torch.where(valid, sampler_logprobs, torch.zeros_like(sampler_logprobs))
    return torch.where(valid, logprobs - safe, torch.zeros_like(logprobs)), valid


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum of k3 estimates of KL(reference || policy), token count) over masked positions whose
    reference logprob is finite; each log ratio is clamped to +-KL_LOG_RATIO_CLAMP so the sum stays finite."""
    log_ratio, valid = finite_log_ratio(logprobs, reference_logprobs, mask)
    log_ratio = log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * valid
    return float(k3.sum()), float(valid.sum())


def reference_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """[R, T] per-token estimate of KL(policy || reference) with gradient through `logprobs`: k1, k2 or k3."""
    d = (logprobs - reference_logprobs).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) - 1 + d
