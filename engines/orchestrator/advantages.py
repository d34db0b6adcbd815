"""Group-relative advantages (GRPO-style, critic-free), set by the orchestrator on every environment's rows.

Environments score (a reward per row); the orchestrator's loop hands each group's scored rows here, so
every environment kind (single-turn, multi-turn, verifiers) gets the same estimator.
"""

from __future__ import annotations

import statistics

from storage.rollouts import RolloutRow


def group_advantages(rewards: list[float], normalize: bool, eps: float = 1e-4) -> list[float]:
    """reward - group mean, optionally divided by the group's population std (+eps)."""
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if not normalize:
        return centred
    std = statistics.pstdev(rewards)
    return [c / (std + eps) for c in centred]


def with_group_advantages(rows: list[RolloutRow], normalize: bool) -> list[RolloutRow]:
    """The group's scored rows with `advantage` set from their rewards (in place; returned for chaining)."""
    for row, advantage in zip(rows, group_advantages([r.reward for r in rows], normalize), strict=True):
        row.advantage = advantage
    return rows
