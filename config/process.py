"""The slice of the run config each process reads (OUTPUT_DIR/config/<component>.json)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from config.base import Strict
from config.envs import EnvSpec
from config.eval import EvalConfig
from config.inference import InferenceConfig
from config.model import ModelConfig
from config.orchestrator import OrchestratorConfig
from config.run import RunConfig
from config.storage import StorageConfig
from config.tracking import TrackingConfig
from config.trainer import CheckpointConfig, SFTConfig, TrainerConfig
from config.trainer_parallel import TrainerParallelConfig
from config.transport import WeightBroadcastConfig
from config.vllm import SESSION_HEADER


class ComponentPaths(Strict):
    """Where a component finds the run: every process gets the same root, addressed by URL or path."""

    output_dir: str
    run_id: str
    storage: StorageConfig  # how to reach output_dir (endpoint, retries) and what to keep there


class InferenceProcessConfig(Strict):
    run: ComponentPaths
    model: ModelConfig
    inference: InferenceConfig
    seed: int
    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    # What the engine serves at start (rollflow eval): publication `serve_version` of run.output_dir (None: the
    # newest), or with `pretrained` model.path's own weights as version 0 (nothing under run.output_dir is read).
    serve_version: int | None = Field(None, ge=0)
    pretrained: bool = False


class OrchestratorProcessConfig(Strict):
    run: ComponentPaths
    model: ModelConfig  # for the tokenizer and chat template that render prompts
    envs: list[EnvSpec]
    orchestrator: OrchestratorConfig
    inference_url: str  # where the engine listens; resolved by the flow at launch
    session_header: str = SESSION_HEADER  # inference.vllm.router.session_header: the header naming a request's session
    seed: int
    max_steps: int
    async_level: int
    max_off_policy_steps: int
    eval: EvalConfig = EvalConfig()  # eval.interval > 0: evaluate the served policy on held-out tasks as it trains


class TrainerProcessConfig(Strict):
    run: ComponentPaths
    model: ModelConfig
    trainer: TrainerConfig
    tracking: TrackingConfig
    mlflow_run_id: str | None  # set by the flow so trainer metrics land in the flow's MLflow run
    checkpoint: CheckpointConfig
    resume_step: int | None  # the verified checkpoint the flow chose to restart from (None: start at version 0)
    seed: int
    max_steps: int
    max_off_policy_steps: int
    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    eval: EvalConfig = EvalConfig()  # eval.interval > 0: merge the online evaluations into metrics.jsonl
    mode: Literal["rl"] = "rl"


class SFTProcessConfig(Strict):
    run: ComponentPaths
    model: ModelConfig
    envs: list[EnvSpec]
    sft: SFTConfig
    num_threads: int
    seed: int
    parallel: TrainerParallelConfig = TrainerParallelConfig()  # the warm-up's torchrun ranks (`warmup_parallel`)
    mode: Literal["sft"] = "sft"


def component_configs(
    cfg: RunConfig,
    run_id: str,
    inference_url: str,
    mlflow_run_id: str | None = None,
    resume_step: int | None = None,
) -> dict[str, BaseModel]:
    """Split the run config into the slice each process reads."""
    paths = ComponentPaths(output_dir=cfg.output_dir, run_id=run_id, storage=cfg.storage)
    return {
        "sft": SFTProcessConfig(
            run=paths,
            model=cfg.model,
            envs=cfg.envs,
            sft=cfg.sft,
            num_threads=cfg.trainer.num_threads,
            seed=cfg.seed,
            parallel=warmup_parallel(cfg),
        ),
        "inference": InferenceProcessConfig(
            run=paths, model=cfg.model, inference=cfg.inference, seed=cfg.seed, weight_broadcast=cfg.weight_broadcast
        ),
        "orchestrator": OrchestratorProcessConfig(
            run=paths,
            model=cfg.model,
            envs=cfg.envs,
            orchestrator=cfg.orchestrator,
            inference_url=inference_url,
            session_header=cfg.inference.vllm.router.session_header,
            seed=cfg.seed,
            max_steps=cfg.max_steps,
            async_level=cfg.async_level,
            max_off_policy_steps=cfg.max_off_policy_steps,
            eval=cfg.eval,
        ),
        "trainer": TrainerProcessConfig(
            run=paths,
            model=cfg.model,
            trainer=cfg.trainer,
            tracking=cfg.tracking,
            mlflow_run_id=mlflow_run_id,
            checkpoint=cfg.checkpoint,
            resume_step=resume_step,
            seed=cfg.seed,
            max_steps=cfg.max_steps,
            max_off_policy_steps=cfg.max_off_policy_steps,
            weight_broadcast=cfg.weight_broadcast,
            eval=cfg.eval,
        ),
    }


def warmup_parallel(cfg: RunConfig) -> TrainerParallelConfig:
    """The warm-up's ranks: the trainer's ranks of one node (it runs on the first trainer node), as FSDP2
    data parallelism only (any model shards that way); one process when it only publishes (`sft.steps =
    0`) or adapts LoRA weights (one process, like the LoRA trainer)."""
    p = cfg.trainer.parallel
    world = p.world_size // cfg.placement.trainer_nodes
    if cfg.sft.steps == 0 or cfg.model.lora is not None:
        world = 1
    return TrainerParallelConfig(world_size=world, backend=p.c10d_backend)
