"""rollflow's own policy-loss variants (docs/algorithm.md has each formula, its source and parameters).

Each is a `LossSpec` whose parameters are its model in config/loss.py. Notation per token: l the trainer's
logprob (with gradient), m the sampler's, p the proximal policy's (the trainer's at the step's start),
A the advantage, sg() stop-gradient; "old" is m with `old_policy = "sampler"` and p with "proximal", where
the behaviour weight w = min(sg(exp(p - m)), behaviour_cap) multiplies the term (decoupled PPO).

Overflow: a ratio that carries a gradient is exponentiated from a log ratio clamped to +-RATIO_LOG_LIMIT
(verl's clamp), a ratio without one from a log ratio clamped to +-60 (`exp_log_ratio`), and off the mask the
log ratio is 0; so no variant makes inf, or inf * 0 = NaN, even for a log ratio of 100 in float32.
"""

from __future__ import annotations

import torch

from config import loss as cfg
from engines.trainer.losses.base import LossInputs, LossSpec, LossTerms, exp_log_ratio, masked

# |log ratio| beyond which a ratio with gradient is held constant (exp(20) ~ 5e8): finite in float32
RATIO_LOG_LIMIT = 20.0


def _exp(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with gradient on `mask` (log ratio clamped to +-RATIO_LOG_LIMIT), 1 elsewhere."""
    return torch.exp(masked(log_ratio, mask).clamp(-RATIO_LOG_LIMIT, RATIO_LOG_LIMIT))


def _unit(x: LossInputs) -> torch.Tensor:
    """exp(l - sg(l)) on the mask: 1 in value, grad l in gradient (a REINFORCE term's carrier); 1 elsewhere."""
    return torch.exp(masked(x.logprobs - x.logprobs.detach(), x.mask))


def _old(x: LossInputs, old_policy: str) -> torch.Tensor:
    return x.proximal_logprobs if old_policy == "proximal" else x.sampler_logprobs


def _behaviour(x: LossInputs, old_policy: str, cap: float) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
    """(w, its metrics): min(sg(exp(p - m)), cap) against the proximal policy, 1 against the sampler."""
    if old_policy != "proximal":
        return 1.0, {}
    with torch.no_grad():
        raw = exp_log_ratio(x.proximal_logprobs - x.sampler_logprobs, x.mask)
        w = raw.clamp(max=cap)
    return w, {"behaviour_weight": w, "behaviour_capped": (raw > cap).to(w.dtype)}


def _clipped_surrogate(
    r: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(r A, clip(r, low, high) A), where the clipped branch is the smaller one and differs)."""
    surr1 = r * adv
    surr2 = r.clamp(low, high) * adv
    return torch.minimum(surr1, surr2), (surr2 < surr1).detach()


def ppo_clip(x: LossInputs, p: cfg.PPOClipLoss) -> LossTerms:
    """r = exp(l - old); term = -w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)."""
    log_ratio = x.logprobs - _old(x, p.old_policy)
    w, metrics = _behaviour(x, p.old_policy, p.behaviour_cap)
    objective, clipped = _clipped_surrogate(_exp(log_ratio, x.mask), x.advantages, 1 - p.clip_low, 1 + p.clip_high)
    return LossTerms(
        per_token=masked(-w * objective, x.mask),
        ratio=exp_log_ratio(log_ratio.detach(), x.mask),
        dropped=torch.zeros_like(x.mask),
        clipped=x.mask & clipped,
        metrics=metrics,
    )


def tis(x: LossInputs, p: cfg.TISLoss) -> LossTerms:
    """rho = sg(exp(l - m)); term = -min(rho, cap) exp(l - sg(l)) A (gradient -min(rho, cap) A grad l)."""
    rho = exp_log_ratio((x.logprobs - x.sampler_logprobs).detach(), x.mask)
    return LossTerms(
        per_token=masked(-rho.clamp(max=p.cap) * _unit(x) * x.advantages, x.mask),
        ratio=rho,
        dropped=torch.zeros_like(x.mask),
        clipped=x.mask & (rho > p.cap),
    )


def mis(x: LossInputs, p: cfg.MISLoss) -> LossTerms:
    """rho_i = sg(exp(mean over sample i's tokens of (l - m))) (the geometric-mean ratio);
    keep_i = mask_low <= rho_i <= mask_high; term = -keep_i rho_i exp(l - sg(l)) A."""
    with torch.no_grad():
        log_rho = x.sequence_mean(x.logprobs - x.sampler_logprobs)
        rho = torch.exp(log_rho.clamp(-60.0, 60.0))
        keep_seq = (rho >= p.mask_low) & (rho <= p.mask_high)
        keep = x.mask & x.per_token(keep_seq.to(rho.dtype)).bool()
        weight = x.per_token(rho)
    return LossTerms(
        per_token=masked(-weight * _unit(x) * x.advantages, keep),
        ratio=weight,
        dropped=x.mask & ~keep,
        clipped=torch.zeros_like(keep),
    )


def icepop(x: LossInputs, p: cfg.IcePopLoss) -> LossTerms:
    """k = sg(exp(old' - m)) with old' = p (proximal) or l (sampler); keep = mask_low <= k <= mask_high;
    sampler: term = -keep k exp(l - sg(l)) A (= masked_is with IcePop's bounds);
    proximal: term = -keep k min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(l - p)."""
    proximal = p.old_policy == "proximal"
    with torch.no_grad():
        anchor = x.proximal_logprobs if proximal else x.logprobs
        k = exp_log_ratio(anchor - x.sampler_logprobs, x.mask)
        keep = x.mask & (k >= p.mask_low) & (k <= p.mask_high)
    if proximal:
        r = _exp(x.logprobs - x.proximal_logprobs, keep)
        objective, clipped = _clipped_surrogate(r, x.advantages, 1 - p.clip_low, 1 + p.clip_high)
        metrics = {"policy_ratio": r.detach()}
    else:
        objective, clipped = _unit(x) * x.advantages, torch.zeros_like(keep)
        metrics = {}
    return LossTerms(
        per_token=masked(-k * objective, keep),
        ratio=k,
        dropped=x.mask & ~keep,
        clipped=keep & clipped,
        metrics=metrics,
    )


def cispo(x: LossInputs, p: cfg.CISPOLoss) -> LossTerms:
    """r = sg(exp(l - old)); term = -w clamp(r, ratio_min, ratio_max) A l (the value uses l itself)."""
    w, metrics = _behaviour(x, p.old_policy, p.behaviour_cap)
    r = exp_log_ratio((x.logprobs - _old(x, p.old_policy)).detach(), x.mask)
    return LossTerms(
        per_token=masked(-w * r.clamp(p.ratio_min, p.ratio_max) * x.advantages * x.logprobs, x.mask),
        ratio=r,
        dropped=torch.zeros_like(x.mask),
        clipped=x.mask & ((r < p.ratio_min) | (r > p.ratio_max)),
        metrics=metrics,
    )


def gspo(x: LossInputs, p: cfg.GSPOLoss) -> LossTerms:
    """GSPO-token: s_i = sg(exp(mean over sample i's tokens of (l - old))); s_it = s_i exp(l - sg(l));
    term = -w min(s_it A, clip(s_it, 1 - clip_low, 1 + clip_high) A)."""
    w, metrics = _behaviour(x, p.old_policy, p.behaviour_cap)
    with torch.no_grad():
        log_s = x.sequence_mean(x.logprobs - _old(x, p.old_policy)).clamp(-RATIO_LOG_LIMIT, RATIO_LOG_LIMIT)
        s = x.per_token(torch.exp(log_s))
    objective, clipped = _clipped_surrogate(s * _unit(x), x.advantages, 1 - p.clip_low, 1 + p.clip_high)
    return LossTerms(
        per_token=masked(-w * objective, x.mask),
        ratio=s,
        dropped=torch.zeros_like(x.mask),
        clipped=x.mask & clipped,
        metrics=metrics,
    )


def ipo(x: LossInputs, p: cfg.IPOLoss) -> LossTerms:
    """r = exp(l - m); keep = |exp(l) - exp(m)| <= threshold (sg); term = -keep adv_tau A r + kl_tau (l - m)^2,
    the squared log ratio on every masked token (prime-rl's ipo_loss_fn)."""
    log_ratio = x.logprobs - x.sampler_logprobs
    with torch.no_grad():
        moved = (torch.exp(x.logprobs) - torch.exp(x.sampler_logprobs)).abs()
        keep = x.mask & (moved <= p.threshold)
    policy = masked(p.adv_tau * x.advantages * _exp(log_ratio, keep), keep)
    return LossTerms(
        per_token=masked(-policy + p.kl_tau * log_ratio.square(), x.mask),
        ratio=exp_log_ratio(log_ratio.detach(), x.mask),
        dropped=x.mask & ~keep,
        clipped=torch.zeros_like(keep),
    )


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


def _proximal(params: object) -> bool:
    return getattr(params, "old_policy", "sampler") == "proximal"


MASKED_IS = LossSpec(fn=masked_is, params=cfg.MaskedISLoss)
PPO_CLIP = LossSpec(fn=ppo_clip, params=cfg.PPOClipLoss, uses_proximal=_proximal)
TIS = LossSpec(fn=tis, params=cfg.TISLoss)
MIS = LossSpec(fn=mis, params=cfg.MISLoss, sequence_level=True)
ICEPOP = LossSpec(fn=icepop, params=cfg.IcePopLoss, uses_proximal=_proximal)
CISPO = LossSpec(fn=cispo, params=cfg.CISPOLoss, uses_proximal=_proximal)
GSPO = LossSpec(fn=gspo, params=cfg.GSPOLoss, sequence_level=True, uses_proximal=_proximal)
IPO = LossSpec(fn=ipo, params=cfg.IPOLoss)
