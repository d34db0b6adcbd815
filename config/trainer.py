"""The trainer's settings: optimizer, loss, warm-up, checkpoints."""

from __future__ import annotations

from pydantic import Field

from config.base import Strict
from config.trainer_parallel import TrainerParallelConfig


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up over the first N RL steps")


class LossConfig(Strict):
    """Importance-weighted policy gradient with trust-region token masking (docs/algorithm.md)."""

    mask_low: float = Field(0.5, gt=0, lt=1)
    mask_high: float = Field(2.0, gt=1)


class SFTConfig(Strict):
    """Short supervised warm-up run before RL; its result is published as policy version 0."""

    steps: int = Field(200, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)


class TrainerConfig(Strict):
    optim: OptimConfig = OptimConfig()
    parallel: TrainerParallelConfig = TrainerParallelConfig()
    loss: LossConfig = LossConfig()
    num_threads: int = Field(1, gt=0)
    micro_batch_size: int = Field(64, gt=0)
    packing: bool = Field(
        False, description="pack several samples per row (block-diagonal attention) instead of padding each"
    )
    measure_mismatch: bool = Field(
        True, description="keep recent policies in memory to measure mismatch_kl on stale samples"
    )
    keep_sampling_mask: bool = Field(
        True,
        description="score each sampled token on the support the sampler's top-k / top-p kept (the lake's "
        "completion_kept), so the importance ratio is unbiased; false: full vocabulary (docs/algorithm.md)",
    )
    enable_router_replay: bool = Field(
        False,
        description="MoE: route each token to the experts the sampler chose (R3), recomputing only the gate "
        "weights; turns on inference.enable_return_routed_experts",
    )


class CheckpointConfig(Strict):
    """Trainer checkpoints (weights, optimizer, RNG, run state): what a resume restarts from."""

    interval: int = Field(5, gt=0, description="checkpoint every N trainer steps (and always at max_steps)")
