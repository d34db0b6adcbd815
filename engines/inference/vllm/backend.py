"""The vLLM backend: requests go upstream to vLLM servers, weight updates to every one of their workers.

    front end --> a replica's router, or its only vLLM server   (generation)
             \\-> every vLLM server (pause, collective_rpc, resume)   (weight updates)

With several replicas (inference.num_infer_replicas, each behind its own router) a request goes to the
replica its session hashes to (round robin without one), and the router in front of that replica picks the
server (consistent_hash on the session, which it reads from ROUTER_SESSION_HEADER). A session's requests
carry an `X-Request-Id` of `<session>-<random>`, so vLLM's own request ids (and `--enable-log-requests`
lines) name the session they served.

Generation requests are forwarded with a `cache_salt` naming the policy version they start under, so no
prefix cached under an older policy serves a newer one, and come back with `policy_version` (at the start)
and `policy_version_end` (at the finish) on every choice (streamed: on each choice's last chunk). An update
materializes the publication as a local safetensors file, closes the gate to new requests, pauses every
server keeping its in-flight requests, has every worker load the file (rollflow_vllm_worker.WeightLoader
via vLLM's /collective_rpc), and resumes: requests that were in flight finish under the new policy and
say so in `policy_version_end`. With inference.enable_return_routed_experts (MoE router replay) vLLM's
base64 `routed_experts` become the rollout's [prompt + completion - 1, layers, top_k] lists. `prompt_logprobs`
(a distillation teacher's scoring) goes to vLLM as it is and comes back in vLLM's own shape; a teacher
(`role = "teacher"`) serves its model directory as it is and refuses weight updates.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines import protocol as api
from engines.inference.backend import Backend, BackendError, Body, Generation, served_name
from launch.vllm import ROUTER_SESSION_HEADER

log = logging.getLogger("rollflow.inference.vllm")
# The publication materialized for the workers: (version) -> local safetensors path.
Materialize = Callable[[int], Awaitable[str]]


@dataclass
class Upstream:
    """Where generation goes (`entries`: each replica's router or only server) and the servers that hold
    weights (every vLLM server of every replica)."""

    entries: list[str]
    servers: list[str]
    version: int
    open_gate: asyncio.Event = field(default_factory=asyncio.Event)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _turn: itertools.count = field(default_factory=itertools.count)

    def entry(self, session: str | None) -> str:
        """The replica of a session (a stable hash, the same in every process), else the next in turn."""
        if len(self.entries) == 1:
            return self.entries[0]
        k = zlib.crc32(session.encode()) if session else next(self._turn)
        return self.entries[k % len(self.entries)]


def upstream_headers(gen: Generation) -> dict[str, str]:
    """The client's x- headers, the session under the header the router reads, and the request id. The
    session is the configured header's value only, so the router and `Upstream.entry` agree on it."""
    headers = {k: v for k, v in gen.headers.items() if k != ROUTER_SESSION_HEADER}
    if gen.session:
        headers[ROUTER_SESSION_HEADER] = gen.session
    if gen.request_id:
        headers["x-request-id"] = gen.request_id
    return headers


def decode_routes(b64: str, positions: int) -> list[list[list[int]]]:
    """vLLM's `routed_experts` (base64 of a .npy [seq, layers, top_k] array, seq counted from the prompt's
    first token) as the rollout column: the `positions` = prompt + completion - 1 the model ran."""
    import base64
    import io

    import numpy as np

    routes = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    if routes.ndim != 3 or routes.shape[0] < positions:
        raise ValueError(f"vLLM routed_experts of shape {routes.shape}: expected [>= {positions}, layers, top_k]")
    return routes[:positions].astype(np.int64).tolist()


def salt(version: int) -> str:
    return f"rollflow-policy-{version}"


def upstream_error(r: httpx.Response) -> BackendError:
    """vLLM's error (its OpenAI error body, or its older flat one) with vLLM's status."""
    try:
        body = r.json()
        message = (body.get("error") or {}).get("message") or body.get("message") or body.get("detail")
    except (ValueError, AttributeError):
        message = None
    return BackendError(r.status_code, f"vLLM: {message or r.text[:500]}")


async def _each(client: httpx.AsyncClient, servers: list[str], path: str, **kwargs) -> list[httpx.Response]:
    responses = await asyncio.gather(*(client.post(s + path, **kwargs) for s in servers))
    for r in responses:
        if r.status_code >= 400:
            raise RuntimeError(f"{r.request.url}: HTTP {r.status_code}: {r.text[:300]}")
    return list(responses)


async def apply_update(client: httpx.AsyncClient, up: Upstream, path: str, version: int) -> list[dict]:
    """Pause (keeping in-flight requests), load `path` on every worker of every server, resume. A failed update
    leaves the gate closed: some servers may then hold the new weights and others the old, and a request
    served now would carry the wrong policy version (seen as mismatch_kl 3e-3 after a replica died mid-update).
    The process exits when a server died, or the orchestrator's timeout ends the attempt, and the flow
    restarts from the checkpoint."""
    up.open_gate.clear()
    try:
        await _each(client, up.servers, "/pause", params={"mode": "keep"})
        rpc = {"method": "rollflow_load", "args": [path, version], "timeout": 600}
        responses = await _each(client, up.servers, "/collective_rpc", json=rpc)
        up.version = version
    finally:  # resume whatever did pause, also when the load failed (the error then reaches the caller)
        await _each(client, up.servers, "/resume")
    up.open_gate.set()
    return [item for r in responses for item in r.json().get("results", [])]


class VLLMBackend(Backend):
    """`client` talks to vLLM (with the attempt's secret: processes.launch); `procs` are the vLLM
    processes this backend watches and stops (none when something else runs them)."""

    def __init__(self, up: Upstream, materialize: Materialize, client: httpx.AsyncClient, model_name: str,
                 max_model_len: int, procs: list[subprocess.Popen] | None = None):  # fmt: skip
        self.up, self.materialize, self.client, self.procs = up, materialize, client, procs or []
        self.model_name, self.max_model_len = model_name, max_model_len
        self.fixed = False  # the distillation teacher: no weight updates

    async def _start(self, gen: Generation) -> tuple[str, dict[str, Any], dict[str, str], int]:
        """Where the request goes, its upstream body and headers, and the version it starts under."""
        await self.up.open_gate.wait()  # no request starts under a version that is being replaced
        start = self.up.version
        body = {**gen.body.model_dump(exclude_none=True), "cache_salt": salt(start)}
        # vLLM cannot report the support its top-k / top-p kept: the choices come back without `kept_sizes`
        # (a run that needs them is refused at load, engines/inference/backend.py `kept_support`)
        body.pop("return_kept_sizes", None)
        # rollflow's opt-in for routes: vLLM returns them whenever its server records them (the front end drops
        # them from an answer that did not ask)
        body.pop("return_routed_experts", None)
        path = "/v1/chat/completions" if gen.chat else "/v1/completions"
        return self.up.entry(gen.session) + path, body, upstream_headers(gen), start

    async def generate(self, gen: Generation) -> Body:
        url, body, headers, start = await self._start(gen)
        r = await self.client.post(url, json=body, headers=headers)
        if r.status_code != 200:
            raise upstream_error(r)
        out = r.json()
        for choice in out.get("choices", []):
            choice["policy_version"], choice["policy_version_end"] = start, self.up.version
            if isinstance(routes := choice.get("routed_experts"), str):
                prompt = body["prompt"] if isinstance(body.get("prompt"), list) else choice.get("prompt_token_ids")
                prompt = prompt or out.get("prompt_token_ids") or []
                choice["routed_experts"] = decode_routes(routes, len(prompt) + len(choice["token_ids"]) - 1)
        return out

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        url, body, headers, start = await self._start(gen)
        async with self.client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise upstream_error(r)
            async for line in r.aiter_lines():
                data = line.removeprefix("data: ").strip() if line.startswith("data: ") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        choice["policy_version"], choice["policy_version_end"] = start, self.up.version
                yield chunk

    async def health(self) -> api.HealthResponse:
        for entry in self.up.entries:
            try:
                r = await self.client.get(entry + "/health")
            except httpx.TransportError as exc:
                raise BackendError(503, f"vLLM at {entry} is unreachable: {exc!r}") from exc
            if r.status_code != 200:
                raise BackendError(503, f"vLLM at {entry} is not healthy (HTTP {r.status_code})")
        stats = {"vllm_servers": len(self.up.servers), "replicas": len(self.up.entries)}
        return api.HealthResponse(status="ok", policy_version=self.up.version, stats=stats)

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        if self.fixed:
            raise BackendError(409, "this server is the distillation teacher: its weights never change")
        if req.version is None:
            raise BackendError(422, "the vLLM backend loads publications by version, not by path", "path")
        async with self.up.update_lock:
            if req.version < self.up.version:
                raise BackendError(409, f"version {req.version} is older than the served {self.up.version}")
            t0 = time.perf_counter()
            try:
                path = await self.materialize(req.version)
            except FileNotFoundError as exc:
                raise BackendError(404, str(exc)) from exc
            t1 = time.perf_counter()
            try:
                results = await apply_update(self.client, self.up, path, req.version)
            except httpx.TransportError as exc:  # a server died: watch() ends the process, the flow restarts it
                raise BackendError(503, f"a vLLM server is unreachable during the weight update: {exc!r}") from exc
        return api.UpdateWeightsResponse(
            policy_version=self.up.version, load_s=t1 - t0, apply_s=time.perf_counter() - t1, workers=results
        )

    async def watch(self) -> None:
        """Return as soon as any vLLM process exits, so the process fails and the flow restarts inference."""
        while not (dead := [p for p in self.procs if p.poll() is not None]):
            await asyncio.sleep(1)
        log.error(f"vLLM process {dead[0].pid} exited with code {dead[0].returncode}; stopping")

    async def close(self) -> None:
        from engines.inference.vllm.processes import stop

        await self.client.aclose()
        await asyncio.to_thread(stop, self.procs)


def refuse_vision(model_dir: Path) -> None:
    """A vision-language model directory (config.json has vision_config) is refused with the reason (the load-time
    check refuses it first when the CLI knows the model is one)."""
    from engines.inference.vllm import NO_VISION

    config = model_dir / "config.json"
    if config.exists() and "vision_config" in json.loads(config.read_text()):
        raise SystemExit(f"{model_dir} is a vision-language model: {NO_VISION}")


async def create(cfg) -> VLLMBackend:
    """Materialize the newest publication, start the deployment's vLLM servers and routers on this host, wait
    until every one answers, and front them."""
    from engines.inference.vllm import processes
    from launch import vllm as vllm_launch
    from storage import weights
    from storage.fs import Storage

    if getattr(cfg, "shared", None) is not None:  # the entry point refuses it first; a direct call too
        from engines.inference.vllm import NO_SHARED

        raise SystemExit(f"a shared deployment cannot run on the vLLM backend: {NO_SHARED}")
    processes.check_local(cfg.inference)
    python = processes.vllm_python(cfg.inference)
    fs, root = Storage(cfg.run.storage).open(cfg.run.output_dir)
    cache = processes.cache_dir(cfg.run.run_id)
    if cfg.pretrained:  # rollflow eval --model: the directory as it is, served as version 0
        from engines.models.modeldir import resolve

        model_dir, version = resolve(cfg.model).directory, 0
    else:
        latest = cfg.serve_version if cfg.serve_version is not None else weights.latest_version(fs, root)
        if latest is None:
            raise SystemExit(
                f"no committed weights under {weights.weights_root(cfg.run.output_dir)}; run the warm-up first"
            )
        version = latest
        model_dir = processes.materialize(fs, root, version, cache)
    refuse_vision(Path(str(model_dir)))
    nodes = ["127.0.0.1"] * (vllm_launch.nodes_per_replica(cfg.inference) * cfg.inference.vllm.num_infer_replicas)
    name, max_len = served_name(cfg), cfg.model.max_seq_len
    replicas = vllm_launch.render(
        cfg.inference, str(model_dir), max_len, nodes, python, False, str(processes.WORKER_DIR), name
    )
    token = processes.new_token()  # this attempt's: every vLLM route but /health answers only to it
    procs = processes.launch(replicas, token)
    try:
        urls = [p.url for r in replicas for p in r.processes if p.url]
        waited = processes.wait_ready(urls, procs, cfg.inference.vllm.startup_timeout_s)
    except BaseException:
        processes.stop(procs)
        raise
    log.info(f"vLLM ready in {waited:.1f}s on policy version {version}")
    servers = [p.url for r in replicas for p in r.processes if p.url and not p.name.startswith("router")]
    up = Upstream([r.url for r in replicas], servers, version)
    up.open_gate.set()

    async def local_file(v: int) -> str:
        return str(await asyncio.to_thread(processes.materialize, fs, root, v, cache) / "model.safetensors")

    client = httpx.AsyncClient(timeout=httpx.Timeout(900.0), headers={"Authorization": f"Bearer {token}"})
    backend = VLLMBackend(up, local_file, client, name, max_len, procs)
    backend.fixed = cfg.role == "teacher"
    return backend
