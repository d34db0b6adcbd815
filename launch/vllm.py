"""The exact processes of a vLLM deployment: argv and environment of every vLLM server and vllm-router.

Data flow: `InferenceConfig` (host, dtype, and in `inference.vllm` the shape, parallel, router, offload and
vllm_extra; config/vllm.py) + the
model directory + the nodes it is placed on -> `render()` -> one `Replica` per `num_infer_replicas`, each a
list of `Process`es and the URL requests enter by. `--dry-run` writes the result to OUTPUT_DIR/config/
(`plan_files`, the vLLM backend's launch plan) with placeholders ({model}, {node0}, ...); a local launch
(engines/inference/vllm/processes.py) renders with the newest publication and 127.0.0.1 for every node and
runs it; under Slurm the same processes become the srun placement, one node each.

Ports: the k-th vLLM server of the whole deployment listens on `deployment.backend_port + k` and the r-th
replica's router on `router.port + r`, so a deployment fits on any number of hosts, one included.
Imports only the config and the standard library.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from config.inference import InferenceConfig
from config.redact import ENV_KEY, is_reference, redact_env
from config.vllm import DisaggregatedDeployment, KVCacheOffloadConfig, MultiNodeDeployment, VLLMConfig

API_SERVER = "vllm.entrypoints.openai.api_server"  # the `vllm` console script looks for a dist named `vllm`
WORKER_EXTENSION = "rollflow_vllm_worker.WeightLoader"
# Every route but /health needs the per-attempt secret the launcher puts in TOKEN_ENV (worker/rollflow_vllm_auth.py):
# vLLM's --api-key would leave the dev-mode routes (/collective_rpc, /pause, /sleep, ...) open.
AUTH_MIDDLEWARE = "rollflow_vllm_auth.RequireToken"
TOKEN_ENV = "ROLLFLOW_VLLM_TOKEN"
LOOPBACK = "127.0.0.1"  # a single-node server and its proxy share the host: nothing else needs to reach it
DP_RPC_PORT = 13345  # the data-parallel coordinator's port on a spanning server's first node
NIXL_SIDE_CHANNEL_PORT = 5600  # P/D: the k-th server's NIXL handshake port is this + k
MOONCAKE_MASTER_PORT, MOONCAKE_METADATA_PORT = 50051, 8080
PREFILL_ALL2ALL, DECODE_ALL2ALL = "deepep_high_throughput", "deepep_low_latency"
# The header vllm-router's consistent_hash reads a session from (fixed in vllm-router 0.1.17): the vLLM
# backend forwards the session under it, whatever inference.router.session_header clients use.
ROUTER_SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class Process:
    name: str
    node: str  # the host it runs on (a placeholder in a dry run)
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # where it serves HTTP; None for a headless rank
    files: dict[str, str] = field(default_factory=dict)  # written (relative to the config dir) before it starts

    def shell(self) -> str:
        """The command as one shell line: secrets stay references ("${HF_TOKEN}", expanded by the shell that
        runs the line) or are masked; the keys were validated at load and are checked again here."""
        return (" ".join(_assignments(self.env)) + " " if self.env else "") + shlex.join(self.argv)


def _assignments(env: dict[str, str]) -> list[str]:
    out = []
    for key, value in sorted(redact_env(env).items()):
        if not ENV_KEY.fullmatch(key):
            raise RenderError(f"environment key {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        out.append(f'{key}="{value}"' if is_reference(value) else f"{key}={shlex.quote(value)}")
    return out


@dataclass(frozen=True)
class Replica:
    index: int
    nodes: list[str]
    processes: list[Process]
    url: str  # the entry point: the router, or the only server


@dataclass
class Context:
    """What one render needs besides the config; `next_server` hands out ports and NIXL channels."""

    cfg: InferenceConfig
    model: str
    max_model_len: int
    python: str
    router_bin: str
    worker_path: str
    name: str
    next_server: int = 0

    @property
    def vllm(self) -> VLLMConfig:
        return self.cfg.vllm


class RenderError(ValueError):
    """The shape cannot run where it was asked to (e.g. mooncake outside Slurm)."""


def nodes_per_replica(cfg: InferenceConfig) -> int:
    d = cfg.vllm.deployment
    if isinstance(d, MultiNodeDeployment):
        return d.num_nodes
    if isinstance(d, DisaggregatedDeployment):
        return d.nodes
    return 1


def render(
    cfg: InferenceConfig,
    model: str = "{model}",
    max_model_len: int = 64,
    nodes: list[str] | None = None,
    python: str | None = None,
    under_slurm: bool = False,
    worker_path: str = "{worker_path}",
    name: str = "rollflow",
) -> list[Replica]:
    """Every process of the deployment; `nodes` lists hosts in placement order (default: placeholders)."""
    per, copies = nodes_per_replica(cfg), cfg.vllm.num_infer_replicas
    total = per * copies
    nodes = nodes or [f"{{node{i}}}" for i in range(total)]
    if len(nodes) != total:
        raise RenderError(f"the deployment needs {total} nodes ({copies} x {per}), got {len(nodes)}")
    offload = cfg.vllm.kv_cache_offload
    if offload is not None and offload.type == "mooncake" and not under_slurm:
        raise RenderError(
            "inference.kv_cache_offload.type = 'mooncake' runs only under Slurm (a shared store over RDMA); "
            "use type = 'native' for a local run"
        )
    python = python or cfg.vllm.python
    router_bin = str(python).rsplit("/", 1)[0] + "/vllm-router" if "/" in python else "vllm-router"
    ctx = Context(cfg, model, max_model_len, python, router_bin, worker_path, name)
    return [_replica(ctx, r, nodes[r * per : (r + 1) * per]) for r in range(copies)]


def _replica(ctx: Context, r: int, nodes: list[str]) -> Replica:
    rep = _shape(ctx, r, nodes)
    offload = ctx.vllm.kv_cache_offload
    if offload is None or offload.type != "mooncake":
        return rep
    return Replica(r, nodes, [*_mooncake(ctx, r, nodes, offload), *rep.processes], rep.url)


def _mooncake(ctx: Context, r: int, nodes: list[str], offload: KVCacheOffloadConfig) -> list[Process]:
    """One master + metadata server on the replica's first node, one client per node contributing its
    DRAM (and SSD) to the shared pool; vLLM's workers attach in standalone-store mode."""
    assert offload.cpu is not None
    master = f"{nodes[0]}:{MOONCAKE_MASTER_PORT}"
    store: dict[str, Any] = {
        "metadata_server": f"http://{nodes[0]}:{MOONCAKE_METADATA_PORT}/metadata",
        "protocol": "rdma",
    }
    store |= {"master_server_address": master, "mode": "standalone-store", "global_segment_size": 0}
    files = {f"mooncake-r{r}.json": json.dumps(store, sort_keys=True)}
    argv = ["mooncake_master", f"--rpc_port={MOONCAKE_MASTER_PORT}", "--enable_http_metadata_server=true"]
    out = [
        Process(
            f"mooncake-master-r{r}",
            nodes[0],
            [*argv, f"--http_metadata_server_port={MOONCAKE_METADATA_PORT}"],
            files=files,
        )
    ]
    for i, node in enumerate(nodes):
        client = [
            "mooncake_client",
            f"--master_server_address={master}",
            f"--global_segment_size={offload.cpu.num_bytes}",
        ]
        client += [f"--storage_root_dir={offload.disk.path}"] if offload.disk else []
        out.append(Process(f"mooncake-client-r{r}-node{i}", node, client))
    return out


def _shape(ctx: Context, r: int, nodes: list[str]) -> Replica:
    d = ctx.vllm.deployment
    if isinstance(d, DisaggregatedDeployment):
        return _disaggregated(ctx, r, nodes, d)
    if isinstance(d, MultiNodeDeployment) and ctx.vllm.enable_expert_parallel:
        servers = _spanning(ctx, f"r{r}", nodes, role=None, env={})
    elif isinstance(d, MultiNodeDeployment):
        servers = [_server(ctx, f"r{r}-node{i}", node, _base_flags(ctx, role=None), {}) for i, node in enumerate(nodes)]
    else:
        servers = [_server(ctx, f"r{r}", nodes[0], _base_flags(ctx, role=None), {}, bind=LOOPBACK)]
    if len(servers) == 1:
        return Replica(r, nodes, servers, _url(servers[0]))
    router = _router(ctx, r, nodes[0], ["--worker-urls", *[_url(s) for s in servers if s.url]])
    return Replica(r, nodes, [*servers, router], _url(router))


def _disaggregated(ctx: Context, r: int, nodes: list[str], d: DisaggregatedDeployment) -> Replica:
    servers: list[Process] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    groups = [("prefill", d.num_prefill_replicas, d.num_prefill_nodes, d.prefill_env_overrides)]
    groups.append(("decode", d.num_decode_replicas, d.num_decode_nodes, d.decode_env_overrides))
    at = 0
    for role, copies, per, env in groups:
        for c in range(copies):
            group = _spanning(ctx, f"r{r}-{role}{c}", nodes[at : at + per], role=role, env=env)
            servers += group
            urls[role] += [_url(s) for s in group if s.url]
            at += per
    flags = ["--vllm-pd-disaggregation"]
    flags += [x for u in urls["prefill"] for x in ("--prefill", u)]
    flags += [x for u in urls["decode"] for x in ("--decode", u)]
    router = _router(ctx, r, nodes[0], flags)
    return Replica(r, nodes, [*servers, router], _url(router))


def _spanning(ctx: Context, name: str, nodes: list[str], role: str | None, env: dict[str, str]) -> list[Process]:
    """One vLLM server over `nodes`: data-parallel ranks split evenly, each node with its own API server
    (hybrid load balancing, so the router spreads requests over the nodes), coordinated from the first."""
    p = ctx.vllm.parallel
    if len(nodes) == 1:
        return [_server(ctx, name, nodes[0], _base_flags(ctx, role), env)]
    if p.dp % len(nodes):
        raise RenderError(f"{name}: inference.parallel.dp={p.dp} must be a multiple of its {len(nodes)} nodes")
    local = p.dp // len(nodes)
    out = []
    for i, node in enumerate(nodes):
        flags = _base_flags(ctx, role)
        flags += ["--data-parallel-size-local", str(local), "--data-parallel-start-rank", str(i * local)]
        flags += ["--data-parallel-address", nodes[0], "--data-parallel-rpc-port", str(DP_RPC_PORT)]
        flags += ["--data-parallel-hybrid-lb"]
        out.append(_server(ctx, f"{name}-node{i}", node, flags, env))
    return out


def _base_flags(ctx: Context, role: str | None) -> list[str]:
    v = ctx.vllm
    flags = ["--model", ctx.model, "--served-model-name", ctx.name, "--max-model-len", str(ctx.max_model_len)]
    flags += ["--dtype", ctx.cfg.dtype, "--seed", "0", "--worker-extension-cls", WORKER_EXTENSION]
    flags += ["--middleware", AUTH_MIDDLEWARE]
    flags += ["--tensor-parallel-size", str(v.parallel.tp), "--data-parallel-size", str(v.parallel.dp)]
    if v.enable_expert_parallel or role is not None:
        flags.append("--enable-expert-parallel")
    if role is not None:
        flags += ["--all2all-backend", PREFILL_ALL2ALL if role == "prefill" else DECODE_ALL2ALL]
    if ctx.cfg.enable_return_routed_experts:
        flags.append("--enable-return-routed-experts")
    kv = _kv_transfer(v.kv_cache_offload, role)
    if kv is not None:
        flags += ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))]
    if v.kv_cache_offload is not None:
        flags.append("--enable-prefix-caching")  # offload stores prefix-cached blocks
    return flags + _extra_flags(v.vllm_extra)


def _kv_transfer(offload: KVCacheOffloadConfig | None, role: str | None) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config: NIXL between prefill and decode, an offloading connector, or both."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"} if role else None
    tier = _offload_connector(offload) if offload else None
    if nixl and tier:
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [nixl, tier]},
        }
    return nixl or tier


def _offload_connector(offload: KVCacheOffloadConfig) -> dict[str, Any]:
    assert offload.cpu is not None  # validated: a cpu tier is required
    if offload.type == "mooncake":  # the store's address and sizes come from MOONCAKE_CONFIG_PATH
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    extra: dict[str, Any] = {"cpu_bytes_to_use": offload.cpu.num_bytes}
    if offload.disk is not None:  # a CPU primary tier with a filesystem tier behind it
        extra |= {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": offload.disk.path}],
        }
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _extra_flags(extra: dict[str, Any]) -> list[str]:
    """vllm_extra {name: value} -> flags: true is a bare flag, false is left out, dicts/lists go as JSON."""
    out: list[str] = []
    for key, value in extra.items():
        flag = "--" + key.lstrip("-").replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return out


def _server(ctx: Context, name: str, node: str, flags: list[str], env: dict[str, str], bind: str = "") -> Process:
    k = ctx.next_server
    ctx.next_server += 1
    port = ctx.vllm.deployment.server_port + k
    argv = [ctx.python, "-m", API_SERVER, *flags, "--host", bind or node, "--port", str(port)]
    # dev mode serves /pause, /resume and /collective_rpc, which the vLLM backend's weight updates use; with
    # AUTH_MIDDLEWARE only the holder of the attempt's secret (given at launch, never rendered) reaches them
    full_env = {**ctx.vllm.env, "PYTHONPATH": ctx.worker_path, "VLLM_SERVER_DEV_MODE": "1", **env}
    if (offload := ctx.vllm.kv_cache_offload) is not None and offload.type == "mooncake":
        full_env["MOONCAKE_CONFIG_PATH"] = f"{{config_dir}}/mooncake-{name.split('-')[0]}.json"
    if "--kv-transfer-config" in flags and "NixlConnector" in flags[flags.index("--kv-transfer-config") + 1]:
        full_env |= {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": node,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT + k),
        }
    return Process(f"vllm-{name}", node, argv, full_env, f"http://{bind or node}:{port}")


def _router(ctx: Context, r: int, node: str, flags: list[str]) -> Process:
    """A replica's vllm-router on its first node. It forwards the proxy's Authorization header to the servers
    and probes their /health without one; its own routes (/add_worker, ...) have no authentication."""
    rc = ctx.vllm.router
    port = rc.port + r
    argv = [ctx.router_bin, "--host", node, "--port", str(port), "--policy", rc.policy]
    # vllm-router always serves Prometheus metrics, by default on 29000: two routers on a host would clash
    argv += ["--prometheus-host", node, "--prometheus-port", str(rc.metrics_port + r), *flags]
    return Process(f"router-r{r}", node, argv, {}, f"http://{node}:{port}")


def _url(p: Process) -> str:
    assert p.url is not None
    return p.url


def plan_files(cfg) -> dict[str, str]:
    """The vLLM backend's launch plan (a `RunConfig` in): what `--dry-run` and every attempt write to
    OUTPUT_DIR/config/: every vLLM server and router the deployment runs, with placeholders for the
    publication ({model}) and the nodes ({node0}, ...)."""
    replicas = render(cfg.inference, max_model_len=cfg.model.max_seq_len, under_slurm=True)
    return {
        "vllm-plan.json": json.dumps(plan_json(replicas), indent=2) + "\n",
        "vllm-commands.sh": plan_script(replicas),
    }


def plan_json(replicas: list[Replica]) -> dict:
    return {"replicas": [asdict(r) for r in replicas]}


def plan_script(replicas: list[Replica]) -> str:
    """The commands as shell lines, one per process, grouped by node (what `srun` runs on each)."""
    lines = ["# rendered by rollflow (launch/vllm.py); one line per process"]
    for rep in replicas:
        lines.append(f"# replica {rep.index}: entry {rep.url}")
        for p in rep.processes:
            lines += [f"# {p.name} on {p.node}"]
            lines += [f"cat > {{config_dir}}/{name} <<'EOF'\n{text}\nEOF" for name, text in p.files.items()]
            lines += [p.shell()]
    return "\n".join(lines) + "\n"
