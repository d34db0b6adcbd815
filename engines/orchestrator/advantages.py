"""Advantage estimators: the interface a plugin exports (`AdvantageSpec`) and rollflow's own (GRPO, RLOO,
REINFORCE++-baseline), pure Python (the orchestrator never imports torch).

An estimator is a function `fn(groups, params) -> advantages`: `groups` holds the rewards of every group of
one step that uses it (one list per group, in order; a multi-turn episode is one row, so one reward), `params`
an instance of its `params` class (a pydantic model, validated from the profile at load). It returns one
advantage per reward, in the same nesting. engines/orchestrator/estimators.py resolves the configured
estimators, calls them once per step and checks what they return; docs/algorithm.md gives the formulas.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from config.advantage import GrpoParams, ReinforcePPParams, RlooParams
from storage.rollouts import RolloutRow

Groups = list[list[float]]


@dataclass(frozen=True)
class AdvantageSpec:
    """What an estimator plugin exports (by entry point in `rollflow.advantages` or import path): its function
    and the pydantic model its parameters (`args` in the profile) are validated with."""

    fn: Callable[[Groups, Any], Groups]
    params: type[BaseModel]


def group_advantages(rewards: list[float], normalize: bool, eps: float = 1e-4) -> list[float]:
    """reward - group mean, optionally divided by the group's population std (+eps)."""
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if not normalize:
        return centred
    std = statistics.pstdev(rewards)
    return [c / (std + eps) for c in centred]


def with_group_advantages(rows: list[RolloutRow], normalize: bool) -> list[RolloutRow]:
    """The group's scored rows with `advantage` set from their rewards by GRPO (in place; returned for chaining)."""
    for row, advantage in zip(rows, group_advantages([r.reward for r in rows], normalize), strict=True):
        row.advantage = advantage
    return rows


def grpo(groups: Groups, params: GrpoParams) -> Groups:
    """A_i = (R_i - mean(R)) / (pstd(R) + eps) per group; without normalize_std, R_i - mean(R)."""
    return [group_advantages(rewards, params.normalize_std, params.eps) for rewards in groups]


def _leave_one_out(rewards: list[float]) -> list[float]:
    if min(rewards) == max(rewards):  # every baseline is R_i itself: exactly 0, whatever the rounding of the sum
        return [0.0] * len(rewards)
    total, others = sum(rewards), len(rewards) - 1
    return [r - (total - r) / others for r in rewards]


def rloo(groups: Groups, params: RlooParams) -> Groups:
    """A_i = R_i - mean_{j != i} R_j per group (a group needs two rewards or more)."""
    return [_leave_one_out(rewards) for rewards in groups]


def reinforce_pp(groups: Groups, params: ReinforcePPParams) -> Groups:
    """A_i = R_i - mean(group) (with group_baseline), then (A_i - mean_B(A)) / (pstd_B(A) + eps) over every row
    of the batch B (all the groups given)."""
    centred = [group_advantages(rewards, normalize=False) if params.group_baseline else rewards for rewards in groups]
    flat = [a for group in centred for a in group]
    if min(flat) == max(flat):  # nothing to tell apart: exactly 0 (the normalisation divides 0 by eps)
        return [[0.0] * len(group) for group in centred]
    # With the group baseline every group sums to 0, so the batch mean is 0: taken as exactly 0, a zero-variance
    # group keeps advantages of exactly 0 instead of the rounding error of a sum of zero-sum groups.
    mean, std = 0.0 if params.group_baseline else statistics.fmean(flat), statistics.pstdev(flat)
    return [[(a - mean) / (std + params.eps) for a in group] for group in centred]


GRPO = AdvantageSpec(grpo, GrpoParams)
RLOO = AdvantageSpec(rloo, RlooParams)
REINFORCE_PP = AdvantageSpec(reinforce_pp, ReinforcePPParams)
