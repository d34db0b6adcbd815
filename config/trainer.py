"""The trainer's settings: optimizer, loss, checkpoints (supervised fine-tuning: config/sft.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.loss import LossConfig, MaskedISLoss, ReferenceConfig, sequence_level, uses_proximal
from config.trainer_parallel import TrainerParallelConfig


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up over the first N RL steps")


class TrainerConfig(Strict):
    optim: OptimConfig = OptimConfig()
    parallel: TrainerParallelConfig = TrainerParallelConfig()
    loss: LossConfig = Field(MaskedISLoss(), description="the policy loss: `type` and its parameters")
    reference: ReferenceConfig = ReferenceConfig()
    mini_batches: int = Field(1, gt=0, description="optimizer steps per epoch over each rollout step's samples")
    epochs: int = Field(1, gt=0, description="passes over each rollout step's samples")
    num_threads: int = Field(1, gt=0)
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the precision of the trainer's forwards (the loss's, the proximal and reference scoring, "
        "mismatch_kl's history): bfloat16 casts the parameters for each forward, as an engine serving a bf16 copy "
        "computes; weights, gradients, AdamW's state and the log-softmax stay float32. Faster only on CPUs with bf16 "
        'matmul units (AMX, AVX512-BF16); belongs with inference.dtype = bfloat16 (docs/algorithm.md "Trainer '
        'precision"); one trainer process only',
    )
    micro_batch_size: int = Field(64, gt=0)
    background_writes: bool = Field(
        True,
        description="a single trainer process writes its weight publications and checkpoints in a thread, in order, "
        "while it trains on (engines/trainer/background.py); the last checkpoint, and one SIGUSR1 asks for, in line",
    )
    poll_interval_s: float = Field(
        0.01,
        gt=0,
        description="how often the trainer reads whether the rollout step it waits for is committed (one small read "
        "each; a request on an object store)",
    )
    packing: bool = Field(
        False, description="pack several samples per row (block-diagonal attention) instead of padding each"
    )
    prefix_sharing: bool = Field(
        True,
        description="forward a group's shared prompt once: its samples' completions follow it in one row and "
        "attend to it (the same logprobs and gradients); only for groups where that costs fewer FLOPs than "
        "separate rows (short completions after a long prompt). Not with trainer.parallel.cp > 1, MoE routing "
        "records or a vision-language policy (engines/trainer/layout.py)",
    )
    measure_mismatch: bool = Field(
        True, description="keep recent policies in memory to measure mismatch_kl on stale samples"
    )
    mismatch_sample_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="mismatch_kl: the fraction of the samples drawn by an older policy than the trainer's that "
        "its history rescores (deterministic per step and sample id; 1.0: all); the current policy's samples "
        "are all measured, from the loss's own forward; error at 0.25 on tiny-cpu: median 13%, 90th percentile "
        "41% of the step's figure (docs/algorithm.md)",
    )
    report_mfu: bool = Field(
        True,
        description="report each step's model FLOPs utilisation (`mfu`): the step's matmul FLOPs over train_s, "
        "against this CPU's matmul peak at the model's shapes in compute_dtype, measured once at the first step "
        "(about 0.1 s; engines/trainer/flops.py); one trainer process only",
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

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per rollout step."""
        return self.mini_batches * self.epochs

    @model_validator(mode="after")
    def _loss_fits_schedule(self) -> TrainerConfig:
        if uses_proximal(self.loss) and self.optimizer_steps == 1:
            raise ValueError(
                f"loss.old_policy = 'proximal' with one optimizer step per rollout step (mini_batches = "
                f"{self.mini_batches}, epochs = {self.epochs}) makes the ratio 1 and the clip inert: raise "
                "trainer.mini_batches or trainer.epochs, or use loss.old_policy = 'sampler'"
            )
        if self.compute_dtype != "float32" and self.parallel.world_size > 1:
            raise ValueError(
                f"trainer.compute_dtype = {self.compute_dtype!r} is for one trainer process; under torchrun "
                f"(parallel.world_size = {self.parallel.world_size}) FSDP sets the precision (bfloat16 parameters "
                "on GPU ranks, float32 on CPU ranks): use compute_dtype = 'float32'"
            )
        if sequence_level(self.loss) and self.parallel.cp > 1:
            raise ValueError(
                f"loss.type = {self.loss.type!r} with aggregation {self.loss.aggregation!r} reads whole samples, "
                f"which context parallelism splits across ranks (parallel.cp = {self.parallel.cp}): use a "
                "token-level variant with token_mean or constant aggregation, or cp = 1"
            )
        return self


class CheckpointConfig(Strict):
    """Trainer checkpoints (weights, optimizer, RNG, run state): what a resume restarts from."""

    interval: int = Field(5, gt=0, description="checkpoint every N trainer steps (and always at max_steps)")
