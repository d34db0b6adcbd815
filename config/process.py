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
from config.sft import SFTConfig
from config.storage import StorageConfig
from config.teacher import TeacherConfig
from config.tenant import SharedConfig, SharedInferenceSettings
from config.tracking import TrackingConfig
from config.trainer import CheckpointConfig, TrainerConfig
from config.trainer_parallel import TrainerParallelConfig
from config.transport import WeightBroadcastConfig
from config.vllm import SESSION_HEADER

# A component's exit code for input it refuses (an SFT dataset with a bad row): a restart would fail the same way.
# sysexits' EX_CONFIG: small codes are taken (uvicorn exits 3 when its port is in use, which a restart can fix).
EXIT_REFUSED = 78


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
    # "teacher": serve model.path's own weights as version 0 and refuse updates (on-policy distillation)
    role: Literal["policy", "teacher"] = "policy"
    # What the engine serves at start (rollflow eval): publication `serve_version` of run.output_dir (None: the
    # newest), or with `pretrained` model.path's own weights as version 0 (nothing under run.output_dir is read).
    serve_version: int | None = Field(None, ge=0)
    pretrained: bool = False
    # a shared deployment's inference server (docs/multitenant.md): run.output_dir is DEPLOY_DIR, model the backbone;
    # it serves every tenant recorded in deploy_dir/tenants/ with its own adapter (embedded backend only)
    shared: SharedInferenceSettings | None = None


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
    teacher: TeacherConfig = TeacherConfig()  # with a path: score every completion token there (teacher_url)
    teacher_url: str | None = None
    eval: EvalConfig = EvalConfig()  # eval.interval > 0: evaluate the served policy on held-out tasks as it trains
    # inference.enable_return_routed_experts: ask for each sample's `routed_experts` (MoE router replay)
    routed_experts: bool = False
    # a tenant of a shared deployment (docs/multitenant.md): every request names this model and carries the
    # tenant's bearer token (TENANT_TOKEN_ENV); the weight sync follows health.tenants[tenant]
    tenant: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,31}$")


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


class SharedTrainerProcessConfig(Strict):
    """`DEPLOY_DIR/config/shared_trainer.json`: the shared trainer of a deployment (engines/trainer/shared.py). It
    loads `model` (the backbone, no [model.lora]) once from run.output_dir's version 0 and trains every tenant
    recorded in `deploy_dir`/tenants/ from that tenant's own OUTPUT_DIR/config/trainer.json."""

    run: ComponentPaths  # the deployment directory, laid out like a run directory
    model: ModelConfig  # the backbone; a tenant's [model] must equal it apart from [model.lora]
    trainer: TrainerConfig  # the process's own settings (num_threads); each tenant trains with its own
    seed: int
    deploy_dir: str
    shared: SharedConfig = SharedConfig()
    mode: Literal["shared"] = "shared"


class SFTRunSettings(Strict):
    """What a `rollflow sft` run adds to the warm-up's slice: checkpoints, publications every
    `checkpoint.interval` steps, metrics, and the checkpoint a restart continues from."""

    checkpoint: CheckpointConfig
    tracking: TrackingConfig
    mlflow_run_id: str | None
    resume_step: int | None


class SFTProcessConfig(Strict):
    run: ComponentPaths
    model: ModelConfig
    envs: list[EnvSpec]
    sft: SFTConfig
    num_threads: int
    seed: int
    parallel: TrainerParallelConfig = TrainerParallelConfig()  # the warm-up's torchrun ranks (`warmup_parallel`)
    sft_run: SFTRunSettings | None = None  # None: the RL warm-up (publishes policy version 0, no checkpoints)
    mode: Literal["sft"] = "sft"


def component_configs(
    cfg: RunConfig,
    run_id: str,
    inference_url: str,
    mlflow_run_id: str | None = None,
    resume_step: int | None = None,
    tenant: str | None = None,
) -> dict[str, BaseModel]:
    """Split the run config into the slice each process reads (`tenant`: the orchestrator's, of a shared
    deployment's tenant run)."""
    paths = ComponentPaths(output_dir=cfg.output_dir, run_id=run_id, storage=cfg.storage)
    teacher = teacher_config(cfg, paths)
    slices: dict[str, BaseModel] = {
        "sft": sft_config(cfg, paths),
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
            teacher=cfg.teacher,
            teacher_url=None if teacher is None else teacher_url(cfg),
            eval=cfg.eval,
            routed_experts=cfg.inference.enable_return_routed_experts,
            tenant=tenant,
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
    return slices | ({"teacher": teacher} if teacher is not None else {})


def teacher_url(cfg: RunConfig) -> str:
    return f"http://{cfg.teacher.inference.host}:{cfg.teacher.inference.port}"


def teacher_config(cfg: RunConfig, paths: ComponentPaths) -> InferenceProcessConfig | None:
    """The teacher's inference process: its model directory served as it is, one token longer than the
    student's sequences (it scores prompt + completion and then draws the one token a request must ask for)."""
    t = cfg.teacher
    if t.path is None:
        return None
    model = ModelConfig(path=t.path, impl=t.impl, max_seq_len=cfg.model.max_seq_len + 1)
    return InferenceProcessConfig(
        run=paths, model=model, inference=t.inference, seed=cfg.seed, role="teacher", pretrained=True
    )


def sft_run_config(
    cfg: RunConfig, run_id: str, mlflow_run_id: str | None = None, resume_step: int | None = None
) -> SFTProcessConfig:
    """The slice a `rollflow sft` run's trainer reads: the warm-up's, plus checkpoints, tracking and resume."""
    paths = ComponentPaths(output_dir=cfg.output_dir, run_id=run_id, storage=cfg.storage)
    settings = SFTRunSettings(
        checkpoint=cfg.checkpoint, tracking=cfg.tracking, mlflow_run_id=mlflow_run_id, resume_step=resume_step
    )
    return sft_config(cfg, paths, settings)


def sft_config(cfg: RunConfig, paths: ComponentPaths, sft_run: SFTRunSettings | None = None) -> SFTProcessConfig:
    """The SFT trainer's slice: the RL warm-up's (`sft_run` None) or a `rollflow sft` run's."""
    return SFTProcessConfig(
        run=paths,
        model=cfg.model,
        envs=cfg.envs,
        sft=cfg.sft,
        num_threads=cfg.trainer.num_threads,
        seed=cfg.seed,
        parallel=warmup_parallel(cfg),
        sft_run=sft_run,
    )


def warmup_parallel(cfg: RunConfig) -> TrainerParallelConfig:
    """The warm-up's ranks: the trainer's ranks of one node (it runs on the first trainer node), as FSDP2
    data parallelism only (any model shards that way); one process when it only publishes (`sft.steps =
    0`) or adapts LoRA weights (one process, like the LoRA trainer)."""
    p = cfg.trainer.parallel
    world = p.world_size // cfg.placement.trainer_nodes
    if cfg.sft.steps == 0 or cfg.model.lora is not None:
        world = 1
    return TrainerParallelConfig(world_size=world, backend=p.c10d_backend, timeout_s=p.timeout_s)
