"""Typed run configuration: one pydantic model per component, composed into `RunConfig`.

Data flow: TOML profiles (composed left to right) + dotted CLI overrides -> `load_run_config`
-> `RunConfig` (validated, cross-component checks) -> `component_configs()` -> one JSON file per
component in `OUTPUT_DIR/config/`, which each process reads at start. A component reads only its own
slice; the fields it shares with others (model shape, seed, paths) are copied into that slice here.

This module imports neither torch nor Prefect so that `--help`, `--dry-run` and validation are instant.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class ModelConfig(_Strict):
    """Decoder-only transformer shape (Llama/Qwen3 naming). `vocab_size` comes from the tokenizer."""

    hidden_size: int = Field(192, gt=0)
    num_layers: int = Field(3, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_seq_len: int = Field(64, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    qk_norm: bool = False  # Qwen3-style per-head RMSNorm on q and k
    tie_word_embeddings: bool = True
    # Qwen3-MoE: with num_experts > 0 every layer's MLP is a sparse block of that many experts
    num_experts: int = Field(0, ge=0, description="experts per MoE layer; 0 = dense model")
    num_experts_per_tok: int = Field(2, gt=0, description="top-k experts each token is routed to")
    moe_intermediate_size: int = Field(256, gt=0, description="hidden width of one expert")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k gate weights to sum to 1")

    @model_validator(mode="after")
    def _experts(self) -> ModelConfig:
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.num_experts={self.num_experts}"
            )
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        return self


class EnvSpec(_Strict):
    """One environment in the task mix; `name` picks an implementation from the registry."""

    name: Literal["reverse-text", "sort-letters"]
    weight: float = Field(1.0, gt=0)
    min_chars: int = Field(3, gt=0)
    max_chars: int = Field(8, gt=0)
    lengths: Literal["uniform", "long-tail"] = Field(
        "uniform", description="payload length distribution; long-tail: mostly min_chars, rarely max_chars"
    )

    @model_validator(mode="after")
    def _range(self) -> EnvSpec:
        if self.min_chars > self.max_chars:
            raise ValueError(f"env {self.name}: min_chars={self.min_chars} > max_chars={self.max_chars}")
        return self


class InferenceConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: the flow picks a free port at launch
    max_batch_size: int = Field(256, gt=0)
    num_threads: int = Field(1, gt=0)
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="precision the engine runs the model in (the trainer stays float32)"
    )
    enable_return_routed_experts: bool = Field(
        False, description="MoE: return each token's routed expert ids (the `routed_experts` rollout column)"
    )


class OrchestratorConfig(_Strict):
    batch_size: int = Field(32, gt=0, description="prompts per step")
    group_size: int = Field(8, gt=1, description="samples per prompt (G)")
    max_new_tokens: int = Field(12, gt=0)
    temperature: float = Field(1.0, gt=0)
    requests_in_flight: int = Field(16, gt=0, description="concurrent group requests to inference")
    normalize_advantages: bool = Field(True, description="divide group-centred rewards by the group std")
    poll_interval_s: float = Field(0.05, gt=0)
    inference_timeout_s: float = Field(120.0, gt=0, description="how long to wait for the engine's /health")


class OptimConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up over the first N RL steps")


class LossConfig(_Strict):
    """Importance-weighted policy gradient with trust-region token masking (docs/algorithm.md)."""

    mask_low: float = Field(0.5, gt=0, lt=1)
    mask_high: float = Field(2.0, gt=1)


class SFTConfig(_Strict):
    """Short supervised warm-up run before RL; its result is published as policy version 0."""

    steps: int = Field(200, ge=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)


class TrainerConfig(_Strict):
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    num_threads: int = Field(1, gt=0)
    micro_batch_size: int = Field(64, gt=0)
    packing: bool = Field(
        False, description="pack several samples per row (block-diagonal attention) instead of padding each"
    )
    measure_mismatch: bool = Field(
        True, description="keep recent policies in memory to measure mismatch_kl on stale samples"
    )
    enable_router_replay: bool = Field(
        False,
        description="MoE: route each token to the experts the sampler chose (R3), recomputing only the gate "
        "weights; turns on inference.enable_return_routed_experts",
    )


class CheckpointConfig(_Strict):
    """Trainer checkpoints (weights, optimizer, RNG, run state): what a resume restarts from."""

    interval: int = Field(5, gt=0, description="checkpoint every N trainer steps (and always at max_steps)")


class RestartConfig(_Strict):
    """How the `rl` flow reacts to a component dying, and how runs are claimed for resumption."""

    max_restarts: int = Field(3, ge=0, description="restarts in a row without a new checkpoint before giving up")
    backoff_s: float = Field(2.0, ge=0, description="wait before the first restart; doubles each time")
    backoff_max_s: float = Field(60.0, ge=0)
    lease_ttl_s: float = Field(
        30.0, gt=0, description="a run whose lease is not renewed for this long counts as not running"
    )


class TrackingConfig(_Strict):
    mlflow: bool = True
    experiment: str = "rollflow"
    tracking_uri: str | None = None  # default: MLFLOW_TRACKING_URI, else sqlite in the run dir


# Option names that carry credentials; these travel by environment (AWS_ACCESS_KEY_ID, ...), never config.
SECRET_OPTION = re.compile(r"(secret|token|password|passwd|credential|(^|_)key($|_)|access_key|session)", re.I)


class StorageConfig(_Strict):
    """Non-secret storage settings (docs/storage.md). Credentials come from the AWS environment variables
    or profiles that botocore reads; `AWS_ENDPOINT_URL` works as well as `endpoint_url`."""

    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    region: str | None = None
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="extra fsspec/s3fs keyword arguments that are not secret"
    )
    timeout_s: float = Field(30.0, gt=0, description="connect and read timeout of one storage request")
    retry_budget_s: float = Field(120.0, ge=0, description="how long one operation may keep retrying")
    retry_max_attempts: int = Field(12, ge=1)
    retry_base_s: float = Field(0.2, gt=0, description="first backoff; doubles per attempt, full jitter")
    retry_max_backoff_s: float = Field(10.0, gt=0)
    keep_last_weights: int | None = Field(None, ge=1, description="None keeps every weight publication")
    keep_every_weights: int | None = Field(None, ge=1, description="also keep publications at multiples of K")
    keep_last_checkpoints: int | None = Field(None, ge=1, description="None keeps every checkpoint")
    keep_every_checkpoints: int | None = Field(None, ge=1, description="also keep checkpoints at multiples of K")
    weights_delta: bool = Field(False, description="publish weights as a diff against the previous version")
    weights_full_every: int = Field(10, ge=1, description="with weights_delta: a full publication every N")
    fsync: bool = Field(True, description="local disk: fsync each file before its rename (power-loss safety)")

    @model_validator(mode="after")
    def _no_secrets(self) -> StorageConfig:
        secret = sorted(k for k in self.options if SECRET_OPTION.search(k))
        if secret:
            raise ValueError(
                f"storage.options.{secret[0]}: credentials are not accepted in config files or flags (they would "
                "be stored in config/run.json and MLflow); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
                "AWS_SESSION_TOKEN or AWS_PROFILE in the environment instead"
            )
        for kind in ("weights", "checkpoints"):
            if getattr(self, f"keep_every_{kind}") is not None and getattr(self, f"keep_last_{kind}") is None:
                raise ValueError(
                    f"storage.keep_every_{kind} only applies together with storage.keep_last_{kind} "
                    f"(without it every {kind} entry is kept anyway); set storage.keep_last_{kind}"
                )
        if self.endpoint_url and "@" in self.endpoint_url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "storage.endpoint_url must not carry user:password@; set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY in the environment instead"
            )
        return self


class RunConfig(_Strict):
    """The whole run: shared settings plus one slice per component."""

    run_name: str = "tiny-cpu"
    output_dir: str = "outputs/tiny-cpu"
    seed: int = 0
    max_steps: int = Field(100, gt=0)
    async_level: int = Field(1, ge=0, description="0 = synchronous on-policy")
    max_off_policy_steps: int = Field(2, ge=0)
    model: ModelConfig = ModelConfig()
    envs: list[EnvSpec] = Field(
        default_factory=lambda: [EnvSpec(name="reverse-text"), EnvSpec(name="sort-letters")], min_length=1
    )
    sft: SFTConfig = SFTConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restart: RestartConfig = RestartConfig()
    storage: StorageConfig = StorageConfig()

    @model_validator(mode="after")
    def _retention_keeps_what_inference_may_load(self) -> RunConfig:
        # The engine may still be loading any of the newest max_off_policy_steps + 2 publications.
        need = self.max_off_policy_steps + 2
        if self.storage.keep_last_weights is not None and self.storage.keep_last_weights < need:
            raise ValueError(
                f"storage.keep_last_weights={self.storage.keep_last_weights} is too small: the inference engine "
                f"may still load any of the newest max_off_policy_steps + 2 = {need} publications; "
                f"set storage.keep_last_weights >= {need}"
            )
        return self

    @model_validator(mode="after")
    def _router_replay_needs_routes(self) -> RunConfig:
        if not self.trainer.enable_router_replay or self.inference.enable_return_routed_experts:
            return self
        if "enable_return_routed_experts" in self.inference.model_fields_set:
            raise ValueError(
                "trainer.enable_router_replay = true needs the sampler's routing: "
                "inference.enable_return_routed_experts must be true (or left unset, which turns it on)"
            )
        self.inference.enable_return_routed_experts = True
        return self

    @model_validator(mode="after")
    def _cross_component(self) -> RunConfig:
        if self.async_level > self.max_off_policy_steps:
            raise ValueError(
                f"async_level={self.async_level} exceeds max_off_policy_steps={self.max_off_policy_steps}: "
                "every sample the orchestrator runs ahead would be dropped; "
                f"set max_off_policy_steps >= {self.async_level}"
            )
        longest_prompt = max(e.max_chars for e in self.envs) + PROMPT_OVERHEAD_TOKENS
        need = longest_prompt + self.orchestrator.max_new_tokens
        if need > self.model.max_seq_len:
            raise ValueError(
                f"model.max_seq_len={self.model.max_seq_len} is too short: prompts take up to "
                f"{longest_prompt} tokens plus orchestrator.max_new_tokens={self.orchestrator.max_new_tokens}; "
                f"set model.max_seq_len >= {need}"
            )
        return self


# Tokens an environment prompt adds around its payload: <bos>, a task tag of up to 4 chars, ':' and '='.
PROMPT_OVERHEAD_TOKENS = 7


class ComponentPaths(_Strict):
    """Where a component finds the run: every process gets the same root, addressed by URL or path."""

    output_dir: str
    run_id: str


class InferenceProcessConfig(_Strict):
    run: ComponentPaths
    model: ModelConfig
    inference: InferenceConfig
    seed: int


class OrchestratorProcessConfig(_Strict):
    run: ComponentPaths
    envs: list[EnvSpec]
    orchestrator: OrchestratorConfig
    inference_url: str  # where the engine listens; resolved by the flow at launch
    seed: int
    max_steps: int
    async_level: int
    max_off_policy_steps: int


class TrainerProcessConfig(_Strict):
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
    mode: Literal["rl"] = "rl"


class SFTProcessConfig(_Strict):
    run: ComponentPaths
    model: ModelConfig
    envs: list[EnvSpec]
    sft: SFTConfig
    num_threads: int
    seed: int
    mode: Literal["sft"] = "sft"


def component_configs(
    cfg: RunConfig,
    run_id: str,
    inference_url: str,
    mlflow_run_id: str | None = None,
    resume_step: int | None = None,
) -> dict[str, BaseModel]:
    """Split the run config into the slice each process reads."""
    paths = ComponentPaths(output_dir=cfg.output_dir, run_id=run_id)
    return {
        "sft": SFTProcessConfig(
            run=paths,
            model=cfg.model,
            envs=cfg.envs,
            sft=cfg.sft,
            num_threads=cfg.trainer.num_threads,
            seed=cfg.seed,
        ),
        "inference": InferenceProcessConfig(run=paths, model=cfg.model, inference=cfg.inference, seed=cfg.seed),
        "orchestrator": OrchestratorProcessConfig(
            run=paths,
            envs=cfg.envs,
            orchestrator=cfg.orchestrator,
            inference_url=inference_url,
            seed=cfg.seed,
            max_steps=cfg.max_steps,
            async_level=cfg.async_level,
            max_off_policy_steps=cfg.max_off_policy_steps,
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
        ),
    }


# Changing these mid-run would mix incompatible data in one run: other weights shapes, other prompts
# or token ids, another group structure. Everything else (learning rate, max_steps, ...) may change.
INCOMPATIBLE_ON_RESUME = ("model", "envs", "seed", "orchestrator.group_size", "sft")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(old: dict, new: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(incompatible, compatible) differences between a stored run config and a resume's config,
    each as {dotted key: (old, new)}."""
    a, b = _flatten(old), _flatten(new)
    changed = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    changed.pop("inference.port", None)  # stored as picked at launch; each attempt picks again
    bad = {k: v for k, v in changed.items() if any(k == p or k.startswith(p + ".") for p in INCOMPATIBLE_ON_RESUME)}
    return bad, {k: v for k, v in changed.items() if k not in bad}
