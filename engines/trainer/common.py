"""Setup pieces shared by the warm-up and the RL loop."""

from __future__ import annotations

import logging
import random

import torch

from engines.model import CausalLM, token_logprobs
from engines.trainer.batch import Batch, PackedBatch

log = logging.getLogger("rollflow.trainer")


def seed_everything(seed: int, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    random.seed(seed)


def batch_logprobs(model: CausalLM, batch: Batch) -> torch.Tensor:
    """Trainer logprobs of every target token under the per-sample sampling temperature, [B, T-1]."""
    logits = model(batch.input_ids)[:, :-1]
    return token_logprobs(logits, batch.targets, batch.temperatures)


def packed_logprobs(model: CausalLM, batch: PackedBatch) -> torch.Tensor:
    """Trainer logprobs of every target of a packed batch, [R, L]; equal to `batch_logprobs` per sample."""
    logits = model(batch.input_ids, batch.positions, batch.attention_mask())
    logp = torch.log_softmax(logits.float() / batch.temperatures[..., None], dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def train_logprobs(model: CausalLM, batch: Batch | PackedBatch) -> torch.Tensor:
    """Logprobs for the loss, whichever layout the trainer chose (`trainer.packing`)."""
    return packed_logprobs(model, batch) if isinstance(batch, PackedBatch) else batch_logprobs(model, batch)
