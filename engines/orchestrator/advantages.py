"""Group-relative advantages (GRPO-style, critic-free)."""

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
