"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): reward shaping before the advantages.

For a completion of L model tokens, L_max = orchestrator.max_new_tokens and buffer B = orchestrator.overlong.buffer:

    penalty(L) = 0                               if L <= L_max - B
               = (L_max - B - L) / B * penalty   if L_max - B < L <= L_max
               = -penalty                        if L > L_max

The shaped reward (reward + penalty(L)) feeds only the advantage estimator: the `reward` column stays the
environment's. Each shaped row records its penalty as the metric `overlong_penalty` (`metric_names`/
`metric_values`), which the trainer averages over the step into `env/overlong_penalty`.

Multi-turn rows (a `completion_mask`: the completion interleaves model turns with environment tokens) are left
unshaped and counted: max_new_tokens bounds each model turn, not the episode, so the episode's length says
nothing about truncation.
"""

from __future__ import annotations

from collections.abc import Sequence

from config.advantage import OverlongConfig
from storage.rollouts import RolloutRow

METRIC = "overlong_penalty"


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """The (non-positive) shaping term for a completion of `length` model tokens."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer * penalty
    return -penalty


def shaped_rewards(
    groups: Sequence[list[RolloutRow]], cfg: OverlongConfig, max_tokens: int
) -> tuple[list[list[float]], int]:
    """(each row's reward plus its overlong penalty, in the groups' nesting; how many multi-turn rows were left
    unshaped). Off (`buffer = 0`): the rewards as they are. Records the penalty on each shaped row."""
    if cfg.buffer == 0:
        return [[r.reward for r in rows] for rows in groups], 0
    skipped = 0
    out: list[list[float]] = []
    for rows in groups:
        shaped = []
        for row in rows:
            if row.completion_mask is not None:
                skipped += 1
                shaped.append(row.reward)
                continue
            term = overlong_penalty(len(row.completion_ids), max_tokens, cfg.buffer, cfg.penalty)
            row.metric_names = [*(row.metric_names or []), METRIC]
            row.metric_values = [*(row.metric_values or []), term]
            shaped.append(row.reward + term)
        out.append(shaped)
    return out, skipped
