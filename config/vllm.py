"""How the vLLM backend is deployed: shape, parallelism, router, KV-cache offload, passthrough flags, and
where vLLM comes from.

Data flow: the vLLM keys of a profile's `[inference]` table (flat there, as the seed writes them, plus the
`[inference.vllm]` table) -> `VLLMConfig`, which `InferenceConfig` holds as `inference.vllm` (validated at
load, every refusal naming the profile's keys) -> `launch/vllm.py` turns them into the exact
vLLM / vllm-router commands and environments (`--dry-run` writes them to OUTPUT_DIR/config/) ->
`engines/inference/vllm/processes.py` launches them for a local run. A backend that does not run a deployment
key ignores none of it silently: the CLI refuses it at load from the backend's declared capabilities
(engines/inference/backend.py `check`).

The shapes follow the seed's inference deployment page: single_node (one vLLM server, tp x dp),
multi_node (num_nodes independent replicas behind one router, or with enable_expert_parallel one
wide-EP server spanning the nodes), disaggregated (prefill and decode node groups, each possibly
several replicas, KV flowing prefill -> decode). `num_infer_replicas` multiplies a whole shape, each
copy behind its own router. Imports only pydantic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.redact import env_problems, is_secret_key


class VLLMParallelConfig(Strict):
    """`inference.parallel`: the parallelism of each vLLM server (the trainer's is config/trainer_parallel.py)."""

    tp: int = Field(1, gt=0, description="tensor parallel size of each vLLM server")
    dp: int = Field(1, gt=0, description="data parallel size (ranks of one server; wide EP: across its nodes)")


class _Ports(Strict):
    server_port: int = Field(
        8100, gt=0, le=65535, alias="backend_port", description="first vLLM server port; a server per node adds 1"
    )


class SingleNodeDeployment(_Ports):
    type: Literal["single_node"] = "single_node"


class MultiNodeDeployment(_Ports):
    type: Literal["multi_node"]
    num_nodes: int = Field(2, ge=2, description="nodes of one inference replica")


class DisaggregatedDeployment(_Ports):
    type: Literal["disaggregated"]
    num_prefill_nodes: int = Field(1, gt=0, description="nodes of each prefill replica")
    num_decode_nodes: int = Field(1, gt=0, description="nodes of each decode replica")
    num_prefill_replicas: int = Field(1, gt=0)
    num_decode_replicas: int = Field(1, gt=0)
    prefill_env_overrides: dict[str, str] = Field(default_factory=dict)
    decode_env_overrides: dict[str, str] = Field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return self.num_prefill_nodes * self.num_prefill_replicas + self.num_decode_nodes * self.num_decode_replicas


DeploymentShape = Annotated[
    SingleNodeDeployment | MultiNodeDeployment | DisaggregatedDeployment, Field(discriminator="type")
]


class OffloadCPU(Strict):
    num_bytes: int = Field(gt=0, description="native: the instance's CPU KV pool; mooncake: what each node adds")


class OffloadDisk(Strict):
    path: str = Field(min_length=1, description="directory of the disk tier (bounded by its filesystem)")


class KVCacheOffloadConfig(Strict):
    """GPU -> CPU (-> disk) KV tiers. native: vLLM's own connectors; mooncake: a shared store (Slurm only)."""

    type: Literal["native", "mooncake"] = "native"
    cpu: OffloadCPU | None = None
    disk: OffloadDisk | None = None

    @model_validator(mode="after")
    def _cpu_tier_first(self) -> KVCacheOffloadConfig:
        if self.cpu is None:
            raise ValueError(
                "inference.kv_cache_offload needs a cpu tier ([inference.kv_cache_offload.cpu] num_bytes = ...); "
                "disk-only offload is not supported: the disk tier sits behind the cpu tier"
            )
        return self


# The header whose value names a rollout session (one per group or episode): clients send it, the inference
# front end reads it, and with several replicas a session stays on one (docs/inference.md).
SESSION_HEADER = "X-Session-ID"


class RouterConfig(Strict):
    """vllm-router in front of a shape's servers (several replicas, or prefill/decode pairs)."""

    policy: Literal["consistent_hash", "round_robin"] = "consistent_hash"
    session_header: str = Field(SESSION_HEADER, description="the header naming a rollout's session (one per rollout)")
    port: int = Field(8000, gt=0, le=65535, description="the router's port; a further replica's router adds 1")
    metrics_port: int = Field(
        29000, gt=0, le=65535, description="the router's Prometheus port (vllm-router's default); +1 per replica"
    )


# vllm_extra keys rollflow sets itself: the config key to use instead.
OWNED_FLAGS = {
    "model": "model.path (the newest weights publication is served)",
    "host": "inference.host",
    "port": "inference.deployment.backend_port",
    "tensor_parallel_size": "inference.parallel.tp",
    "data_parallel_size": "inference.parallel.dp",
    "enable_expert_parallel": "inference.enable_expert_parallel",
    "kv_transfer_config": "inference.kv_cache_offload / inference.deployment.type",
    "worker_extension_cls": "nothing (rollflow's weight loader must stay installed)",
    "max_model_len": "model.max_seq_len",
    "api_key": "nothing: rollflow's own per-attempt secret guards every vLLM route (docs/inference.md)",
    "uds": "nothing: the inference proxy reaches vLLM over TCP, guarded by a per-attempt secret",
}


# The keys of VLLMConfig a profile writes flat in `[inference]` (the seed's layout); the others are `[inference.vllm]`.
SHAPE_KEYS = (
    "deployment", "parallel", "enable_expert_parallel", "kv_cache_offload", "router", "num_infer_replicas", "vllm_extra"
)  # fmt: skip


class VLLMConfig(Strict):
    """What backend 'vllm' reads: the shape keys (`inference.deployment`, `inference.parallel`, ...) and
    `[inference.vllm]` (where vLLM comes from on this host and how long it may take to start)."""

    deployment: DeploymentShape = Field(default_factory=SingleNodeDeployment)
    parallel: VLLMParallelConfig = VLLMParallelConfig()
    enable_expert_parallel: bool = False
    kv_cache_offload: KVCacheOffloadConfig | None = None
    router: RouterConfig = RouterConfig()
    num_infer_replicas: int = Field(
        1, gt=0, description="copies of the whole shape, each behind its own router (the seed's deployment key)"
    )
    vllm_extra: dict[str, Any] = Field(default_factory=dict, description="more vLLM flags: {flag_name: value}")
    python: str = Field(".venv-vllm/bin/python", description="interpreter of the vLLM environment (infra/vllm)")
    env: dict[str, str] = Field(
        default_factory=lambda: {"VLLM_CPU_KVCACHE_SPACE": "1"},
        description="environment of every vLLM server (VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU); a secret "
        'only as a reference, "${HF_TOKEN}", taken from the launching environment at launch',
    )
    startup_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _serving_rules(self) -> VLLMConfig:
        for check in (_wide_ep_fits, _extra_not_owned, _env_by_reference):
            check(self)
        return self


def _wide_ep_fits(s: VLLMConfig) -> None:
    d = s.deployment
    if not (s.enable_expert_parallel and isinstance(d, MultiNodeDeployment)):
        return
    if s.parallel.dp % d.num_nodes:
        raise ValueError(
            f"wide EP (inference.enable_expert_parallel with inference.deployment.type = 'multi_node'): "
            f"inference.parallel.dp={s.parallel.dp} must be a multiple of inference.deployment.num_nodes="
            f"{d.num_nodes} (each node runs dp / num_nodes ranks)"
        )


def replay_without_offload(routed_experts: bool, s: VLLMConfig) -> None:
    """Called by InferenceConfig, which holds `enable_return_routed_experts`."""
    if routed_experts and s.kv_cache_offload is not None:
        raise ValueError(
            "inference.enable_return_routed_experts (router replay; trainer.enable_router_replay turns it on) "
            "is not supported with inference.kv_cache_offload: remove one of them"
        )


def _env_by_reference(s: VLLMConfig) -> None:
    """Every environment a vLLM process gets is written to run.json, inference.json and the plan: names a shell
    takes, and secrets as references ("${HF_TOKEN}", resolved at launch) only."""
    envs = {"inference.vllm.env": s.env}
    if isinstance(d := s.deployment, DisaggregatedDeployment):
        envs |= {"inference.deployment.prefill_env_overrides": d.prefill_env_overrides}
        envs |= {"inference.deployment.decode_env_overrides": d.decode_env_overrides}
    if problems := [p for where, env in envs.items() for p in env_problems(where, env)]:
        raise ValueError("; ".join(problems))


def _extra_not_owned(s: VLLMConfig) -> None:
    for key in s.vllm_extra:
        name = key.lstrip("-").replace("-", "_")
        if name in OWNED_FLAGS:
            raise ValueError(f"inference.vllm_extra.{key} is set by rollflow; use {OWNED_FLAGS[name]} instead")
        if is_secret_key(name):  # a flag's value is in the plan and in the argv every local user can read
            raise ValueError(
                f"inference.vllm_extra.{key}: a secret as a flag would be written to the plan and be visible in "
                'the process list; pass it by environment, e.g. inference.vllm.env.HF_TOKEN = "${HF_TOKEN}"'
            )
