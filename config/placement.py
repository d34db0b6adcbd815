"""Where a run's components go on Slurm: the profile's `[deployment]` section (docs/slurm.md), read
into `RunConfig.placement`. (How the vLLM servers are laid out is the inference deployment, config/vllm.py.)

Data flow: profile `[deployment]` -> `SlurmPlacementConfig` (validated here: node counts add up, Slurm
values well-formed and of characters that cannot break out of the batch script, config/script_text.py;
numbers given for `mem` or `time_limit` are read as text) -> `launch.slurm` renders the
sbatch script (`rollflow submit`, the Slurm worker, `--dry-run`) and, inside an allocation, the `srun`
placement of each component. A local run ignores this section except `[deployment.cpus]`, the CPU binding of
its components (config/cpus.py). Imports only pydantic, like the rest of the config.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.cpus import CpuBindingConfig
from config.script_text import SLURM_NAME, check_name, check_sbatch_option

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, and no limit (the partition's maximum).
TIME_LIMIT = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|(?i:unlimited|infinite)")
MEMORY = re.compile(r"\d+[KMGT]?")


class SlurmJobConfig(Strict):
    """The sbatch request: what `rollflow submit` asks for, and the Slurm worker's defaults."""

    partition: str | None = Field(None, description="sbatch --partition; None: the cluster's default")
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, gt=0, description="CPUs per node for the job (one task per node)")
    mem: str = Field("4G", description="memory per node, sbatch --mem syntax (e.g. 4G, 512000M, 0 = all)")
    time_limit: str = Field("01:00:00", description="sbatch --time (M, H:M:S, D-H:M:S, ...)")
    signal_before_s: int = Field(
        120, ge=0, description="Slurm sends the flow USR1 this long before the time limit (0: no warning)"
    )
    extra_sbatch: list[str] = Field(
        default_factory=list, description="more #SBATCH lines, one '--name[=value]' each, e.g. '--exclusive'"
    )
    setup: list[str] = Field(
        default_factory=list,
        description="shell lines run before the flow, e.g. 'module load cuda': shell by design, not checked",
    )
    srun_args: list[str] = Field(default_factory=list, description="extra srun arguments for every component")

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, SLURM_NAME)

    @field_validator("extra_sbatch")
    @classmethod
    def _one_option_each(cls, lines: list[str]) -> list[str]:
        return [check_sbatch_option(line) for line in lines]

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not TIME_LIMIT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time (minutes, H:M:S, D-H or D-H:M:S, e.g. '90' or '1-00:00:00'; "
                "or 'UNLIMITED')"
            )
        return value

    @field_validator("mem")
    @classmethod
    def _slurm_mem(cls, value: str) -> str:
        if not MEMORY.fullmatch(value):
            raise ValueError(f"{value!r} is not sbatch --mem syntax (e.g. '4G', '512000M', '0')")
        return value


class SlurmPlacementConfig(Strict):
    """Node layout inside one Slurm job, as the multi-node layout: inference on the first
    `inference_nodes` nodes, the trainer on the next `trainer_nodes`, the orchestrator beside the
    trainer's first node. On one node every component shares it. (The seed's `deployment.num_infer_replicas`
    is read as `inference.num_infer_replicas`: config/run.py.)"""

    nodes: int = Field(1, gt=0, description="nodes of the job")
    inference_nodes: int = Field(1, gt=0)
    trainer_nodes: int = Field(1, gt=0)
    slurm: SlurmJobConfig = SlurmJobConfig()
    cpus: CpuBindingConfig = CpuBindingConfig()  # a local run's CPU binding (config/cpus.py)

    @model_validator(mode="after")
    def _counts_add_up(self) -> SlurmPlacementConfig:
        if self.nodes == 1:
            if self.inference_nodes != 1 or self.trainer_nodes != 1:
                raise ValueError(
                    "deployment.nodes=1: every component shares the node, so deployment.inference_nodes and "
                    f"deployment.trainer_nodes must be 1 (got {self.inference_nodes} and {self.trainer_nodes})"
                )
        elif self.inference_nodes + self.trainer_nodes != self.nodes:
            raise ValueError(
                f"deployment.inference_nodes={self.inference_nodes} + deployment.trainer_nodes="
                f"{self.trainer_nodes} must add up to deployment.nodes={self.nodes}"
            )
        return self
