"""The HTTP face of the vLLM backend: the same routes as the embedded engine, in front of vLLM servers.

    orchestrator --> proxy (inference.host:inference.port) --> a replica's router, or its only vLLM server
                                                         \\-> every vLLM server (pause, collective_rpc, resume)

With several replicas (inference.num_infer_replicas, each behind its own router) a request goes to the
replica its `X-Session-ID` hashes to (round robin without one), and the router in front of that replica
picks the server (consistent_hash on the same header by default). A session's requests carry an
`X-Request-Id` of `<session>-<random>`, so vLLM's own request ids (and `--enable-log-requests` lines)
name the session they served.

Generation requests are forwarded with a `cache_salt` naming the policy version they start under, so no
prefix cached under an older policy serves a newer one, and come back with `policy_version` (at the start)
and `policy_version_end` (at the finish) on every choice. `POST /update_weights {version}` (admin token)
materializes the publication as a local safetensors file, closes the gate to new requests, pauses every
server keeping its in-flight requests, has every worker load the file (rollflow_vllm_worker.WeightLoader
via vLLM's /collective_rpc), and resumes: requests that were in flight finish under the new policy and
say so in `policy_version_end`. With inference.enable_return_routed_experts (MoE router replay) vLLM's
base64 `routed_experts` become the rollout's [prompt + completion - 1, layers, top_k] lists.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from engines.protocol import HealthResponse, UpdateWeightsRequest, admin_auth

# The publication materialized for the workers: (version) -> local safetensors path.
Materialize = Callable[[int], Awaitable[str]]


SESSION_HEADER, REQUEST_ID_HEADER = "x-session-id", "x-request-id"


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


def forward_headers(request_headers) -> dict[str, str]:
    """The client's x- headers (X-Session-ID for the router), plus a request id naming the session."""
    headers = {k.lower(): v for k, v in request_headers.items() if k.lower().startswith("x-")}
    if (session := headers.get(SESSION_HEADER)) and REQUEST_ID_HEADER not in headers:
        headers[REQUEST_ID_HEADER] = f"{session}-{secrets.token_hex(4)}"
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
    The entry module exits when a server died, or the orchestrator's timeout ends the attempt, and the flow
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


def build_app(up: Upstream, materialize: Materialize, admin_token: str, client: httpx.AsyncClient):
    """The FastAPI app; `client` talks to vLLM (the servers bind loopback unless configured otherwise)."""
    app = FastAPI(title="rollflow vLLM proxy")

    admin = Depends(admin_auth(admin_token))

    @app.get("/health")
    async def health() -> HealthResponse:
        for entry in up.entries:
            r = await client.get(entry + "/health")
            if r.status_code != 200:
                raise HTTPException(503, f"vLLM at {entry} is not healthy (HTTP {r.status_code})")
        stats = {"vllm_servers": len(up.servers), "replicas": len(up.entries)}
        return HealthResponse(status="ok", policy_version=up.version, stats=stats)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(up.entries[0] + "/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            raise HTTPException(400, "stream=true is not supported through the rollflow vLLM proxy")
        await up.open_gate.wait()  # no request starts under a version that is being replaced
        start = up.version
        body["cache_salt"] = salt(start)
        headers = forward_headers(request.headers)
        r = await client.post(up.entry(headers.get(SESSION_HEADER)) + path, json=body, headers=headers)
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        out = r.json()
        for choice in out.get("choices", []):
            choice["policy_version"], choice["policy_version_end"] = start, up.version
            if isinstance(routes := choice.get("routed_experts"), str):
                prompt = body["prompt"] if isinstance(body.get("prompt"), list) else choice["prompt_token_ids"]
                choice["routed_experts"] = decode_routes(routes, len(prompt) + len(choice["token_ids"]) - 1)
        return JSONResponse(out)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.post("/update_weights", dependencies=[admin])
    async def update_weights(req: UpdateWeightsRequest) -> dict:
        if req.version is None:
            raise HTTPException(422, "the vLLM backend loads publications by version, not by path")
        version = req.version
        async with up.update_lock:
            if version < up.version:
                raise HTTPException(409, f"version {version} is older than the served {up.version}")
            t0 = time.perf_counter()
            try:
                path = await materialize(version)
            except FileNotFoundError as exc:
                raise HTTPException(404, str(exc)) from exc
            t1 = time.perf_counter()
            try:
                results = await apply_update(client, up, path, version)
            except httpx.TransportError as exc:  # a server died: the entry module exits and the flow restarts
                raise HTTPException(503, f"a vLLM server is unreachable during the weight update: {exc!r}") from exc
        return {
            "policy_version": up.version,
            "load_s": t1 - t0,
            "apply_s": time.perf_counter() - t1,
            "workers": results,
        }

    @app.post("/shutdown", dependencies=[admin])
    async def shutdown() -> dict:
        if server := getattr(app.state, "server", None):
            server.should_exit = True
        return {"status": "shutting down"}

    return app
