"""Turn a step's rollout table into right-padded training tensors, split into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    targets: torch.Tensor  # [B, T-1] next tokens
    loss_mask: torch.Tensor  # [B, T-1] 1.0 where the target is a completion token
    sampler_logprobs: torch.Tensor  # [B, T-1] sampler logprob of each completion target, 0 elsewhere
    advantages: torch.Tensor  # [B]
    temperatures: torch.Tensor  # [B]
    versions: torch.Tensor  # [B] policy_version
    versions_end: torch.Tensor  # [B] policy_version_end

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> Batch:
        return Batch(**{k: v[idx] for k, v in self.__dict__.items()})


def right_pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
    return ids


def make_batch(table: pa.Table, pad_id: int) -> Batch:
    cols = table.select(
        ["prompt_ids", "completion_ids", "completion_logprobs", "advantage", "temperature"]
        + ["policy_version", "policy_version_end"]
    ).to_pydict()
    ids = right_pad([p + c for p, c in zip(cols["prompt_ids"], cols["completion_ids"], strict=True)], pad_id)
    mask = torch.zeros((ids.shape[0], ids.shape[1] - 1))
    sampler = torch.zeros_like(mask)
    for i, (p, lps) in enumerate(zip(cols["prompt_ids"], cols["completion_logprobs"], strict=True)):
        start = len(p) - 1  # target index of the first completion token
        mask[i, start : start + len(lps)] = 1.0
        sampler[i, start : start + len(lps)] = torch.tensor(lps)
    return Batch(
        input_ids=ids,
        targets=ids[:, 1:],
        loss_mask=mask,
        sampler_logprobs=sampler,
        advantages=torch.tensor(cols["advantage"], dtype=torch.float32),
        temperatures=torch.tensor(cols["temperature"], dtype=torch.float32),
        versions=torch.tensor(cols["policy_version"]),
        versions_end=torch.tensor(cols["policy_version_end"]),
    )


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    return [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]
