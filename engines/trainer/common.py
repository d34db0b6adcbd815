"""Setup pieces shared by the warm-up and the RL loop."""

from __future__ import annotations

import logging
import random

import torch

from engines.model import CausalLM, token_logprobs
from engines.trainer.batch import Batch
from rollflow.config import ModelConfig

log = logging.getLogger("rollflow.trainer")


def seed_everything(seed: int, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    random.seed(seed)


def build_model(cfg: ModelConfig, vocab_size: int) -> CausalLM:
    model = CausalLM(cfg, vocab_size)
    n = sum(p.numel() for p in model.parameters())
    log.info(f"model: {n / 1e6:.2f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
    return model


def batch_logprobs(model: CausalLM, batch: Batch) -> torch.Tensor:
    """Trainer logprobs of every target token under the per-sample sampling temperature, [B, T-1]."""
    logits = model(batch.input_ids)[:, :-1]
    return token_logprobs(logits, batch.targets, batch.temperatures)
