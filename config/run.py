"""Typed run configuration: one pydantic model per component, composed into `RunConfig`.

Data flow: TOML profiles (composed left to right) + dotted CLI overrides -> `load_run_config`
-> `RunConfig` (validated, cross-component checks) -> `component_configs()` -> one JSON file per
component in `OUTPUT_DIR/config/`, which each process reads at start. A component reads only its own
slice; the fields it shares with others (model shape, seed, paths) are copied into that slice here.

Validators here only check: none assigns into a section. What one key implies for another section is
resolved on the input, before any section validates (`resolve_seed_keys`), so every section validates its
final values once and the order of the checks does not matter.

This module imports neither torch nor Prefect so that `--help`, `--dry-run` and validation are instant.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from config.base import Strict
from config.cpus import CpuPlan
from config.cpus import plan as cpu_plan
from config.envs import EnvFacts, EnvSpec
from config.eval import EvalConfig
from config.inference import InferenceConfig
from config.model import ModelConfig
from config.orchestrator import OrchestratorConfig
from config.placement import SlurmPlacementConfig
from config.script_text import PATH_TEXT, RUN_NAME, check, check_name
from config.sft import SFTConfig
from config.stall import StallConfig
from config.storage import StorageConfig
from config.teacher import TeacherConfig
from config.tenant import SharedConfig
from config.tracking import TrackingConfig
from config.trainer import CheckpointConfig, TrainerConfig
from config.trainer_parallel import check_against_model, check_impl
from config.transport import WeightBroadcastConfig

# The seed's spelling of a key -> the key rollflow stores it as (one value, stored once).
SEED_SPELLINGS: dict[tuple[str, str], tuple[str, str]] = {
    ("deployment", "num_infer_replicas"): ("inference", "num_infer_replicas"),
}


class RestartConfig(Strict):
    """How the `rl` flow reacts to a component dying, and how runs are claimed for resumption."""

    max_restarts: int = Field(3, ge=0, description="restarts in a row without a new checkpoint before giving up")
    backoff_s: float = Field(2.0, ge=0, description="wait before the first restart; doubles each time")
    backoff_max_s: float = Field(60.0, ge=0)
    lease_ttl_s: float = Field(
        30.0, gt=0, description="a run whose lease is not renewed for this long counts as not running"
    )
    stall: StallConfig = StallConfig()  # a live component that makes no progress restarts the attempt


class RunConfig(Strict):
    """The whole run: shared settings plus one slice per component."""

    run_name: str = "tiny-cpu"
    output_dir: str = "outputs/tiny-cpu"
    seed: int = 0
    max_steps: int = Field(100, gt=0)
    async_level: int = Field(1, ge=0, description="0 = synchronous on-policy")
    max_off_policy_steps: int = Field(2, ge=0)
    model: ModelConfig = ModelConfig()
    envs: list[EnvSpec] = Field(
        default_factory=lambda: [EnvSpec(id="reverse-text"), EnvSpec(id="sort-letters")], min_length=1
    )
    sft: SFTConfig = SFTConfig()
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restart: RestartConfig = RestartConfig()
    storage: StorageConfig = StorageConfig()
    placement: SlurmPlacementConfig = Field(
        default_factory=SlurmPlacementConfig, alias="deployment", description="where components run on Slurm"
    )
    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()  # trainer -> engine transport
    eval: EvalConfig = EvalConfig()  # held-out evaluation: `rollflow eval`, and during RL with eval.interval > 0
    teacher: TeacherConfig = TeacherConfig()  # on-policy distillation (config/teacher.py); off without a path
    # a shared deployment's profile (`rollflow shared up`, docs/multitenant.md): tenants, ranks, polling
    shared: SharedConfig | None = None

    @field_validator("run_name")
    @classmethod
    def _run_name_chars(cls, value: str) -> str:
        return check_name(value, RUN_NAME)  # it names the Slurm job and the run's directory

    @field_validator("output_dir")
    @classmethod
    def _output_dir_chars(cls, value: str) -> str:
        return check(value, PATH_TEXT)  # the batch script's --output and command line carry it

    @model_validator(mode="after")
    def _teacher_port(self) -> RunConfig:
        port = self.teacher.inference.port
        if self.teacher.enabled and port and port == self.inference.port:
            raise ValueError(
                f"teacher.inference.port={port} is inference.port too: the teacher is a second server; "
                "give it another port, or 0 for a free one"
            )
        return self

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

    @model_validator(mode="before")
    @classmethod
    def _seed_keys(cls, data: Any) -> Any:
        return resolve_seed_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _router_replay_needs_routes(self) -> RunConfig:
        if self.trainer.enable_router_replay and not self.inference.enable_return_routed_experts:
            raise ValueError(
                "trainer.enable_router_replay = true needs the sampler's routing: "
                "inference.enable_return_routed_experts must be true (or left unset, which turns it on)"
            )
        return self

    @model_validator(mode="after")
    def _trainer_ranks_fill_its_nodes(self) -> RunConfig:
        """Under Slurm the trainer's step runs one torchrun agent per trainer node, each starting
        world_size / trainer_nodes ranks: a remainder, or a node with no rank, has no meaning."""
        nodes, world = self.placement.trainer_nodes, self.trainer.parallel.world_size
        if nodes > 1 and world % nodes:
            raise ValueError(
                f"trainer.parallel.world_size={world} must be a multiple of deployment.trainer_nodes={nodes} "
                f"(each trainer node runs world_size / trainer_nodes ranks): e.g. {nodes * max(1, world // nodes)}"
            )
        remote = "://" in self.output_dir and not self.output_dir.startswith("file://")
        if nodes > 1 and remote:
            # engines/trainer/dcp.py stages an object store's optimizer shards on rank 0's node only
            raise ValueError(
                f"deployment.trainer_nodes={nodes} with output_dir={self.output_dir!r}: a trainer on several nodes "
                "writes its checkpoints to a filesystem every node mounts; use a shared path for output_dir"
            )
        return self

    @model_validator(mode="after")
    def _env_names_unique(self) -> RunConfig:
        labels = [e.label for e in self.envs]
        twice = sorted({n for n in labels if labels.count(n) > 1})
        if twice:
            raise ValueError(
                f"envs: name {', '.join(map(repr, twice))} is used by more than one [[envs]] entry; the lake and "
                "the reward tell environments apart by name: give each entry its own `name`"
            )
        return self

    @model_validator(mode="after")
    def _eval_envs_configured(self) -> RunConfig:
        labels = [e.label for e in self.envs]
        unknown = [n for n in self.eval.envs or [] if n not in labels]
        if unknown:
            raise ValueError(f"eval.envs names {unknown}, which no [[envs]] entry is; valid: {labels}")
        return self

    @model_validator(mode="after")
    def _lora_publications(self) -> RunConfig:
        if self.model.lora is not None and self.storage.weights_delta:
            raise ValueError(
                "model.lora publishes adapters, which are already small: storage.weights_delta = true does not "
                "apply to them; set storage.weights_delta = false or remove [model.lora]"
            )
        if self.model.lora is not None and self.weight_broadcast.type == "collective":
            raise ValueError(
                'model.lora is not supported with weight_broadcast.type = "collective": adapters go through the '
                'filesystem publication; set weight_broadcast.type = "filesystem" (the default) or remove [model.lora]'
            )
        if self.model.lora is not None and self.trainer.parallel.world_size > 1:
            raise ValueError(
                f"model.lora runs on one trainer process; trainer.parallel.world_size = "
                f"{self.trainer.parallel.world_size}: set it to 1 or remove [model.lora]"
            )
        return self

    @model_validator(mode="after")
    def _parallel_fits_model(self) -> RunConfig:
        # With model.path the shape comes from config.json: the trainer checks it again once loaded.
        if self.model.path is None:
            check_against_model(self.trainer.parallel, self.model, self.model.impl)
        elif self.model.impl == "hf":
            check_impl(self.trainer.parallel, "hf")
        return self

    @model_validator(mode="after")
    def _cross_component(self) -> RunConfig:
        if self.async_level > self.max_off_policy_steps:
            raise ValueError(
                f"async_level={self.async_level} exceeds max_off_policy_steps={self.max_off_policy_steps}: "
                "every sample the orchestrator runs ahead would be dropped; "
                f"set max_off_policy_steps >= {self.async_level}"
            )
        # Only the built-in string tasks' prompt length is known before they run; with model.path the chat
        # template's length is known only once the tokenizer loads. The engine refuses longer requests
        # then (docs/models.md).
        payloads = [n for n in (e.max_payload_chars() for e in self.envs) if n is not None]
        longest_prompt = max(payloads, default=0) + PROMPT_OVERHEAD_TOKENS
        need = longest_prompt + self.orchestrator.max_new_tokens
        if self.model.path is None and payloads and need > self.model.max_seq_len:
            raise ValueError(
                f"model.max_seq_len={self.model.max_seq_len} is too short: prompts take up to "
                f"{longest_prompt} tokens plus orchestrator.max_new_tokens={self.orchestrator.max_new_tokens}; "
                f"set model.max_seq_len >= {need}"
            )
        self._check_algorithm()
        if self.orchestrator.group_size > self.inference.max_batch_size:
            raise ValueError(
                f"orchestrator.group_size={self.orchestrator.group_size} exceeds "
                f"inference.max_batch_size={self.inference.max_batch_size}: the engine refuses a request for more "
                f"samples than one batch holds; set inference.max_batch_size >= {self.orchestrator.group_size}"
            )
        return self

    @model_validator(mode="after")
    def _inference_admits_the_orchestrator(self) -> RunConfig:
        """The orchestrator's own load (requests_in_flight requests of group_size, or eval.n, samples) must never
        be refused by the server's admission limits (a refused request would stop the run): an unset token budget
        is raised to it, a limit set below it is refused."""
        inf, o = self.inference, self.orchestrator
        inflight = max(o.requests_in_flight, self.eval.requests_in_flight or 0)
        tokens = inflight * max(o.group_size, self.eval.n) * self.model.max_seq_len
        if inflight > inf.max_queued_requests:
            raise ValueError(
                f"inference.max_queued_requests={inf.max_queued_requests} is below the orchestrator's "
                f"{inflight} concurrent requests (orchestrator.requests_in_flight / eval.requests_in_flight): "
                f"set inference.max_queued_requests >= {inflight}"
            )
        if inf.max_queued_tokens is None and tokens > inf.queued_tokens(self.model.max_seq_len):
            inf.max_queued_tokens = tokens
        if tokens > inf.queued_tokens(self.model.max_seq_len):
            raise ValueError(
                f"inference.max_queued_tokens={inf.queued_tokens(self.model.max_seq_len)} is below the orchestrator's "
                f"load of {tokens} tokens ({inflight} requests x {max(o.group_size, self.eval.n)} samples x "
                f"model.max_seq_len {self.model.max_seq_len}): set inference.max_queued_tokens >= {tokens}"
            )
        return self

    def env_problems(self, facts: list[EnvFacts], rl: bool = True) -> list[str]:
        """The rules joining what loading measured of the environments with the other sections, one message per
        broken rule naming the env, the keys and the fix: each first turn must fit model.max_seq_len with
        orchestrator.max_new_tokens (rl only: an episode with no room fails), and an SFT warm-up on the
        environments' demonstrations needs every environment to have some."""
        problems = []
        limit, new = self.model.max_seq_len, self.orchestrator.max_new_tokens
        for f in facts:
            if rl and f.longest_prompt + new > limit:
                problems.append(
                    f"{f.where}: its first-turn prompts take up to {f.longest_prompt} tokens ({f.prompts} measured "
                    f"with the run's tokenizer) plus orchestrator.max_new_tokens={new}, more than "
                    f"model.max_seq_len={limit}, so its episodes would fail: set model.max_seq_len >= "
                    f"{f.longest_prompt + new}, or shorten the environment's prompts"
                )
        if self.sft.steps > 0 and self.sft.data.type == "envs":
            problems += [
                f"{f.where}: has no demonstrations (it runs its own episodes; their answers are unknown to "
                f"rollflow), so sft.steps={self.sft.steps} would train an empty answer: set [sft] steps = 0, give "
                "[sft.data] a dataset (path or run), or use environments with demonstrations"
                for f in facts
                if not f.demonstrations
            ]
        return problems

    def cpu_plan(self, usable: set[int]) -> CpuPlan:
        """Where a local attempt's components run on this machine's `usable` cores (config/cpus.py): the
        inference server's threads (one set per local vLLM replica) and the trainer's (per rank)."""
        inf = self.inference
        replicas = inf.vllm.num_infer_replicas if inf.backend != "embedded" else 1
        trainer = self.trainer.num_threads * self.trainer.parallel.world_size
        return cpu_plan(self.placement.cpus, usable, inf.num_threads * replicas, trainer)

    def _check_algorithm(self) -> None:
        """The trainer's loss schedule against the step's size and the trainer's process layout."""
        samples = self.orchestrator.batch_size * self.orchestrator.group_size
        if self.trainer.mini_batches > samples:
            raise ValueError(
                f"trainer.mini_batches={self.trainer.mini_batches} exceeds the samples per step "
                f"(orchestrator.batch_size x group_size = {samples}): each mini-batch needs a sample"
            )
        if self.trainer.reference.enabled and self.trainer.parallel.world_size > 1:
            raise ValueError(
                f"trainer.reference.kl_coef > 0 runs the reference in the trainer process, which is not sharded: "
                f"trainer.parallel.world_size = {self.trainer.parallel.world_size} is not supported with it; "
                "set world_size = 1 or reference.kl_coef = 0"
            )


# Tokens an environment prompt adds around its payload: <bos>, a task tag of up to 4 chars, ':' and '='.
PROMPT_OVERHEAD_TOKENS = 7


def resolve_seed_keys(data: dict) -> dict:
    """The input with the seed's spellings read as rollflow's keys (SEED_SPELLINGS; both set to different
    values is refused) and `inference.enable_return_routed_experts` on when `trainer.enable_router_replay`
    is and the input leaves it unset. Idempotent: a stored run config passes through unchanged."""
    out = dict(data)
    for (section, key), (to_section, to_key) in SEED_SPELLINGS.items():
        source, target = _section(out, section), _section(out, to_section)
        if source is None or target is None or key not in source:
            continue
        value = source.pop(key)
        out[section] = source
        if value is None:  # unset (run configs stored by earlier versions write it so)
            continue
        if target.get(to_key, value) != value:
            raise ValueError(
                f"{section}.{key}={value} and {to_section}.{to_key}={target[to_key]} disagree: set one of them "
                f"({section}.{key} is the seed's spelling of {to_section}.{to_key})"
            )
        out[to_section] = {**target, to_key: value}
    trainer, inference = _section(out, "trainer") or {}, _section(out, "inference")
    if inference is not None and _true(trainer.get("enable_router_replay")):
        out["inference"] = {"enable_return_routed_experts": True, **inference}
    return out


def _section(data: dict, name: str) -> dict | None:
    """A section of the input as the keys it sets (a model instance: the fields it was given); None when
    it is neither a table nor a model (its own validation reports that)."""
    section = data.get(name)
    if isinstance(section, BaseModel):
        return section.model_dump(exclude_unset=True)
    if section is None or isinstance(section, dict):
        return dict(section or {})
    return None


def _true(value: Any) -> bool:
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False  # not a boolean: the section's own validation says so


_BOOL = TypeAdapter(bool)
