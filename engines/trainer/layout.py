"""How the trainer cuts a step's samples into forwards: padded rows, packed rows, or rows that share prompts.

A GRPO step holds each prompt `group_size` times, and a padded or packed forward computes that prompt's tokens
once per sample. Prefix sharing (`trainer.prefix_sharing`) places a group's prompt once in a row, followed by each
sample's completion (with the prompt's last token, whose logits score the first completion token); every
completion attends to the prompt and to its own earlier tokens (`PackedBatch.attention_mask`), so its logprobs are
the padded forward's and the prompt's activations take the summed gradients of all its completions, as the
separate forwards' would.

The shared row costs attention over its whole length (a masked dense attention), the separate rows only over each
sample's, so a group shares its prompt only where the shared row's FLOPs (`TokenCost`: the model's Linear layers
per token, attention per token and key) are below its samples' apart: short completions after a long prompt share,
long completions after a short one do not. A group longer than a micro-batch's token budget is split, each part
with the prompt.

Data flow: `Layout.split(batch)` -> `shared_units` (groups by prompt ids) -> `pack_batch(batch, units=...)` ->
`budget_batches`: micro-batches of at most `micro_batch_size` x the longest sample's tokens each. Without a shared
prompt and without `trainer.packing`: the padded micro-batches of `micro_batches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.trainer.batch import Batch, PackedBatch, Unit, micro_batches, pack_batch, sample_lengths


@dataclass(frozen=True)
class TokenCost:
    """A forward + backward's FLOPs per token (Linear layers) and per token per attended key (attention)."""

    linear: float
    attention: float

    def apart(self, lengths: list[int]) -> float:
        """Samples in their own causal rows: each token attends to half its sample on average."""
        return sum(n * (self.linear + self.attention * n / 2) for n in lengths)

    def shared(self, size: int) -> float:
        """One row of `size` tokens under a dense mask: every token's attention runs over the whole row."""
        return size * (self.linear + self.attention * size)


def _chunks(members: list[int], shared: int, lengths: list[int], budget: int) -> list[list[int]]:
    """`members` in runs whose shared row (the prompt once, then each rest) stays within `budget` tokens."""
    runs: list[list[int]] = [[]]
    size = shared
    for i in members:
        rest = lengths[i] - shared
        if runs[-1] and size + rest > budget:
            runs.append([])
            size = shared
        runs[-1].append(i)
        size += rest
    return runs


def shared_units(batch: Batch, cost: TokenCost, budget: int) -> list[Unit]:
    """The batch's samples as packing units: those with the same prompt (at least two tokens, each with a
    completion target) in shared rows of at most `budget` tokens where that costs fewer FLOPs, the rest alone."""
    assert batch.prompt_lengths is not None
    lengths = sample_lengths(batch)
    groups: dict[tuple[int, ...], list[int]] = {}
    units: list[Unit] = []
    for i, (n, p) in enumerate(zip(lengths, batch.prompt_lengths.tolist(), strict=True)):
        if 2 <= p < n:
            groups.setdefault(tuple(batch.input_ids[i, :p].tolist()), []).append(i)
        else:  # nothing to share, or no completion target (the zero-advantage filter's rows)
            units.append(Unit((i,)))
    for prompt, members in groups.items():
        shared = len(prompt) - 1  # the prompt's last token goes with each completion: its logits score the first
        for run in _chunks(members, shared, lengths, budget):
            unit = Unit(tuple(run), shared)
            if len(run) > 1 and cost.shared(unit.size(lengths)) < cost.apart([lengths[i] for i in run]):
                units.append(unit)
            else:
                units.extend(Unit((i,)) for i in run)
    return units


@dataclass(frozen=True)
class Layout:
    """`micro_batch_size` rows per forward, padded; with `pad_id`, packed rows (`packing`) and rows whose samples
    share their prompt (`share`: the cost model that decides where; None: never)."""

    micro_batch_size: int
    pad_id: int | None = None
    packing: bool = False
    share: TokenCost | None = None

    def split(self, batch: Batch) -> list[Batch] | list[PackedBatch]:
        if self.pad_id is None or not batch.packable or len(batch) == 0:
            return micro_batches(batch, self.micro_batch_size)
        longest = max(sample_lengths(batch))
        budget = self.micro_batch_size * longest  # a padded micro-batch's tokens at most
        units = None
        # MoE routing records are per sample (the prompt's too): such samples keep their own rows
        if self.share is not None and batch.routes is None and batch.prompt_lengths is not None:
            units = shared_units(batch, self.share, budget)
            if not any(u.shared for u in units):
                units = None
        if units is None and not self.packing:
            return micro_batches(batch, self.micro_batch_size)
        return budget_batches(pack_batch(batch, self.pad_id, units=units), budget)


def budget_batches(packed: PackedBatch, budget: int) -> list[PackedBatch]:
    """Packed rows, fullest last, in micro-batches of at most `budget` tokens (rows x the fullest row's tokens;
    one row at least), each cut to its fullest row: rows that hold one shared prompt's group vary in length."""
    real = packed.real()
    columns = torch.arange(1, real.shape[1] + 1)
    fills = (columns * real).max(dim=1).values.tolist()  # columns up to each row's last token
    order = sorted(range(len(fills)), key=lambda r: fills[r])
    runs: list[list[int]] = [[]]
    for r in order:
        if runs[-1] and (len(runs[-1]) + 1) * fills[r] > budget:
            runs.append([])
        runs[-1].append(r)
    return [_narrow(packed.select(torch.tensor(run)), max(fills[r] for r in run)) for run in runs]


def _narrow(mb: PackedBatch, width: int) -> PackedBatch:
    """`mb` without the columns after `width` (padding in every row)."""
    return PackedBatch(**{k: None if v is None else v[:, :width] for k, v in mb.__dict__.items()})  # type: ignore[arg-type]


def forward_tokens(mb: Batch | PackedBatch) -> int:
    """The tokens a forward of `mb` computes, padding left out: a packed row's spans and shared prompts."""
    if isinstance(mb, PackedBatch):
        return int(mb.real().sum())
    return int(mb.lengths.sum()) if mb.lengths is not None else mb.input_ids.numel()
