"""The trainer's parallelism (`trainer.parallel`): how many ranks torchrun starts and how they split the work.

The sizes follow torchtitan's `ParallelDims` (which the trainer builds its device mesh with):
`world_size = dp_replicate * dp_shard * cp * tp`, `dp_shard = -1` fills what the others leave, and expert
parallelism borrows its ranks from `dp_shard * cp * tp` (so `ep` must divide that product). Rules that
need the model's shape (heads, experts, sequence length, implementation) are in `check_against_model`,
which the run-level config calls with the profile's shape, the CLI's load step with a `model.path`
directory's config.json, and the trainer again at start; this module imports no torch. (Each vLLM
server's parallelism is config/vllm.py's `VLLMParallelConfig`.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.model import ModelConfig


class TrainerParallelConfig(Strict):
    """torchrun ranks on one node and the mesh they form (docs/parallelism.md)."""

    world_size: int = Field(1, gt=0, description="trainer ranks torchrun starts; 1 = one plain process")
    dp_replicate: int = Field(1, gt=0, description="HSDP: replicas of the sharded model (gradients all-reduced)")
    dp_shard: int = Field(-1, description="FSDP2: ranks one copy of the weights is sharded over; -1 = the rest")
    tp: int = Field(1, gt=0, description="tensor parallel size (splits attention heads and MLP width)")
    cp: int = Field(1, gt=0, description="context parallel size (splits each sequence)")
    ep: int = Field(1, gt=0, description="expert parallel size for MoE models; borrowed from dp_shard * cp * tp")
    rdzv_port: int = Field(
        29400,
        gt=0,
        lt=65536,
        description="deployment.trainer_nodes > 1: torchrun's rendezvous port on trainer node 0 (the rendezvous id is "
        "the run's and the attempt's; two runs whose trainers share node 0 should still use different ports)",
    )
    c10d_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        alias="backend",
        description="torch.distributed backend; auto: nccl on GPU (bf16 mixed precision), gloo on CPU (fp32)",
    )
    timeout_s: float = Field(
        1800.0, gt=0, description="bound on forming the process group and on any one collective; past it the rank fails"
    )

    @model_validator(mode="after")
    def _sizes(self) -> TrainerParallelConfig:
        others = self.dp_replicate * self.cp * self.tp
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"trainer.parallel.dp_shard={self.dp_shard} must be -1 (the rest) or >= 1")
        if self.world_size % others:
            raise ValueError(
                f"trainer.parallel: dp_replicate * cp * tp = {self.dp_replicate} * {self.cp} * {self.tp} = {others} "
                f"does not divide world_size={self.world_size}; valid sizes multiply to the world size"
            )
        if self.dp_shard != -1 and others * self.dp_shard != self.world_size:
            raise ValueError(
                f"trainer.parallel: dp_replicate * dp_shard * cp * tp = {others * self.dp_shard} != "
                f"world_size={self.world_size}; set dp_shard = {self.world_size // others} (or -1 to fill)"
            )
        borrow = self.shard_size * self.cp * self.tp
        if borrow % self.ep:
            raise ValueError(
                f"trainer.parallel.ep={self.ep} must divide dp_shard * cp * tp = {borrow} "
                "(expert parallelism borrows those ranks)"
            )
        return self

    @property
    def shard_size(self) -> int:
        """dp_shard with -1 resolved."""
        return self.dp_shard if self.dp_shard != -1 else self.world_size // (self.dp_replicate * self.cp * self.tp)

    @property
    def dp_size(self) -> int:
        """Ranks that read different samples of a step's batch (replicas x shards)."""
        return self.dp_replicate * self.shard_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def check_impl(p: TrainerParallelConfig, impl: str) -> None:
    """transformers' modeling (`model.impl = "hf"`) gets data parallelism only: its MoE and attention code
    has no expert, context or tensor parallel path here (as in prime-rl, where hf disables the MoE knobs)."""
    if impl == "hf" and (p.tp > 1 or p.cp > 1 or p.ep > 1):
        raise ValueError(
            f'model.impl = "hf" supports only data parallelism (trainer.parallel.dp_shard, dp_replicate); '
            f'got tp={p.tp} cp={p.cp} ep={p.ep}: use model.impl = "custom" (or "auto") for TP, CP and EP'
        )


def check_against_model(p: TrainerParallelConfig, model: ModelConfig, impl: str) -> None:
    """Raise ValueError when the sizes do not fit the model: heads, experts, sequence length, `impl`.

    `impl` is the implementation the trainer runs ("custom" or "hf"; "auto" checks only what both share)."""
    check_impl(p, impl)
    if p.tp > 1 and (model.num_heads % p.tp or model.num_kv_heads % p.tp):
        raise ValueError(
            f"trainer.parallel.tp={p.tp} must divide model.num_heads={model.num_heads} and "
            f"model.num_kv_heads={model.num_kv_heads}"
        )
    if p.ep > 1 and not model.num_experts:
        raise ValueError(f"trainer.parallel.ep={p.ep} needs a MoE model; model.num_experts = 0 (dense): set ep = 1")
    if p.ep > 1 and model.num_experts % p.ep:
        raise ValueError(f"trainer.parallel.ep={p.ep} must divide model.num_experts={model.num_experts}")
    check_cp(p, model)
    check_tp(p, model)
    divisor = 2 * p.cp * p.tp  # torchtitan's seq_len_divisor: load-balanced CP cuts 2 * cp chunks
    if p.cp > 1 and model.max_seq_len % divisor:
        raise ValueError(
            f"trainer.parallel.cp={p.cp} needs model.max_seq_len divisible by 2 * cp * tp = {divisor}; "
            f"model.max_seq_len={model.max_seq_len}"
        )


def check_cp(p: TrainerParallelConfig, model: ModelConfig) -> None:
    """Context parallelism runs with FSDP2/HSDP on dense models: not with tensor parallelism, and not on MoE
    models, whose routing records ([rows, tokens, ...]) would need the same split (neither built)."""
    if p.cp > 1 and (p.tp > 1 or model.num_experts):
        raise ValueError(
            f"trainer.parallel cp={p.cp} runs with data parallelism (dp_shard, dp_replicate) on dense models; "
            f"got tp={p.tp}, model.num_experts={model.num_experts}: set cp = 1, or tp = 1 on a dense model "
            "(docs/parallelism.md)"
        )


def check_tp(p: TrainerParallelConfig, model: ModelConfig) -> None:
    """Tensor parallelism splits attention heads and the dense MLP; the MoE block has no tensor-parallel
    path (so neither does TP with EP): MoE models shard with FSDP2/HSDP and expert parallelism."""
    if p.tp > 1 and model.num_experts:
        raise ValueError(
            f"trainer.parallel.tp={p.tp} on a MoE model (model.num_experts={model.num_experts}): tensor parallelism "
            "runs on dense models only; shard a MoE model with dp_shard / dp_replicate and ep, and set tp = 1 "
            "(docs/parallelism.md)"
        )
