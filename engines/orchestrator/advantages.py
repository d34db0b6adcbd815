"""Group-relative advantages (GRPO-style, critic-free) and the staleness rule."""

from __future__ import annotations

import statistics


def group_advantages(rewards: list[float], normalize: bool, eps: float = 1e-4) -> list[float]:
    """reward - group mean, optionally divided by the group's population std (+eps)."""
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if not normalize:
        return centred
    std = statistics.pstdev(rewards)
    return [c / (std + eps) for c in centred]


def staleness(consuming_step: int, policy_version: int) -> int:
    """Policy steps between the weights that sampled and the weights that train (step is 1-based)."""
    return (consuming_step - 1) - policy_version
