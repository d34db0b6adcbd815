"""The staleness rule: which finished rollouts a step admits, and what happens to an episode that outlived
`max_off_policy_steps` (docs/environments.md, "Long-horizon episodes and the staleness rule").

A model turn's age at consuming step N is `(N - 1) - v`, v the policy version of its first token
(`turn_policy_versions`); an episode's age is its oldest trained turn's. Versions only grow within an episode,
so the stale turns of an episode are always its first ones. What `orchestrator.stale_turns` does with a
multi-turn row whose oldest turn is over the bound:

- `mask`: its stale turns are masked out (`completion_mask` 0 on their tokens; their logprobs stay as sampled)
  and the row is kept with the turns within the bound; its `policy_version` becomes its oldest trained turn's,
  so every trained token is within the bound. A row whose last turn is stale too is dropped.
- `drop`: the row is dropped whole (the age of an episode is then its first turn's, its dispatch version).

Single-turn rows have no turns to mask: over the bound, they are dropped, in either mode. The estimator has
already set every row's advantage over its whole group before this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.rollouts import RolloutRow, staleness


@dataclass
class Admission:
    """What the rule did to one step's rows; the step's manifest records it."""

    dropped: int = 0  # rows not committed
    masked_rows: int = 0  # rows kept with some turns masked
    masked_turns: int = 0  # model turns masked in those rows
    masked_tokens: int = 0  # model tokens masked in those rows

    def meta(self) -> dict[str, int]:
        masked = {"masked_rows": self.masked_rows, "masked_turns": self.masked_turns}
        masked["masked_tokens"] = self.masked_tokens
        return {"dropped": self.dropped, **(masked if self.masked_rows else {})}


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (1s) in a completion mask: one per model turn."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m == 1 and start is None:
            start = i
        elif m != 1 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _masked(row: RolloutRow, step: int, bound: int) -> tuple[RolloutRow, int, int] | None:
    """The row with its stale turns masked, the turns and tokens masked; None: drop it (its last turn is
    stale, or its mask's runs of model tokens do not match its turns, so they cannot be told apart)."""
    versions = row.turn_policy_versions or []
    spans = turn_spans(row.completion_mask or [])
    stale = [staleness(step, v) > bound for v in versions]
    if len(spans) != len(versions) or all(stale):
        return None
    mask = list(row.completion_mask or [])
    cut = [span for span, s in zip(spans, stale, strict=True) if s]
    for start, end in cut:
        mask[start:end] = [0] * (end - start)
    oldest = min(v for v, s in zip(versions, stale, strict=True) if not s)
    kept = row.model_copy(update={"completion_mask": mask, "policy_version": oldest})
    return kept, len(cut), sum(end - start for start, end in cut)


def admit(rows: list[RolloutRow], step: int, bound: int, mode: str) -> tuple[list[RolloutRow], Admission]:
    """The rows step `step` commits under `max_off_policy_steps = bound`, and what the rule did."""
    kept: list[RolloutRow] = []
    done = Admission()
    for row in rows:
        if staleness(step, row.policy_version) <= bound:
            kept.append(row)
            continue
        masked = _masked(row, step, bound) if mode == "mask" and row.turn_policy_versions else None
        if masked is None:
            done.dropped += 1
            continue
        kept.append(masked[0])
        done.masked_rows += 1
        done.masked_turns += masked[1]
        done.masked_tokens += masked[2]
    return kept, done
