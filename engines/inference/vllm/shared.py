"""A shared deployment's server on vLLM (docs/inference.md "A shared deployment on vLLM"): the backbone served by
vLLM with `--enable-lora`, each tenant's adapter publication loaded as a LoRA adapter of its own per version.

    DEPLOY_DIR/weights/step=000000 --materialize--> vLLM --enable-lora --max-loras N --max-lora-rank R'
    DEPLOY_DIR/tenants/<name>.json  --poll (engines/inference/tenants.py, as the embedded shared server)-->
    the tenant's newest publication --copy (verified)--> <cache>/tenants/<name>/a<attempt>/step=V/ (PEFT files)
      --POST /v1/load_lora_adapter {lora_name: <name>-<V>-a<attempt>} on every server--> switch --> unload the old
    request (model = tenant, its token) -> vLLM with model = <name>-<V>-a<attempt>, cache_salt = the same string

The tenant table, the gate (401 / 403 / 404 / 410 / 503), /update_weights {tenant, version} and /health's tenants
are engines/inference/tenants.py's, shared with the embedded server. A request runs wholly on the adapter it started
with (vLLM binds the LoRA at admission), so its policy_version_end is its policy_version; a replaced adapter is
unloaded once the requests that run on it have finished. The cache salt names tenant, version and attempt, so no
KV block is reused across tenants or versions (nor across a resumed attempt that republishes a version). Version 0
(a tenant's copy of the backbone) is the base model itself. R' is max_lora_rank rounded up to a rank vLLM accepts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from config.tenant import SharedInferenceSettings, TenantRecord
from engines import protocol as api
from engines.inference.backend import BackendError, Body, Generation
from engines.inference.tenants import Tenant, TenantGate, Unfit, locate
from engines.inference.vllm.backend import Upstream, VLLMBackend, upstream_error
from storage.fs import read_verified
from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE

log = logging.getLogger("rollflow.inference.shared")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks (0.32)


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM's --max-lora-rank accepts that holds `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def lora_flags(settings: SharedInferenceSettings) -> dict[str, Any]:
    """vLLM's LoRA settings for the deployment (vllm_extra names): every tenant in one batch; twice as many
    adapters held on the CPU side, as a replaced one stays until its requests finish."""
    n = settings.shared.max_tenants
    rank = vllm_rank(settings.shared.max_lora_rank)
    return {"enable_lora": True, "max_loras": n, "max_lora_rank": rank, "max_cpu_loras": 2 * n}


@dataclass
class Local:
    """A tenant's publication ready for vLLM: `path` its PEFT directory here (None: version 0, the backbone)."""

    version: int
    directory: str
    path: str | None


@dataclass
class Served:
    version: int
    adapter: str | None  # vLLM's name of the adapter; None: the base model
    salt: str


class SharedVLLMBackend(TenantGate, VLLMBackend):
    def __init__(self, up: Upstream, client: httpx.AsyncClient, name: str, max_len: int, procs, cache: Path):
        super().__init__(up, _no_full_updates, client, name, max_len, procs)
        self.cache = cache
        self.served: dict[int, Served] = {}  # tenant lease -> what serves it
        self.running: Counter[str] = Counter()  # adapter name -> requests running on it
        self.retired: set[str] = set()  # replaced adapters, unloaded when their last request ends
        self.held: dict[str, str | None] = {}  # generation id -> the adapter it runs on
        self.loaded: set[str] = set()  # adapters loaded into vLLM (/health's stats.lora_adapters)
        self.switching: dict[int, asyncio.Lock] = {}  # tenant lease -> held while its adapter is switched

    # -- the tenant table's hooks (engines/inference/tenants.py) ----------------------------------------

    async def _closed(self, tenant: Tenant, why: str) -> None:
        self.switching.pop(tenant.lease, None)
        served = self.served.pop(tenant.lease, None)
        if served is not None:
            await self._retire(served.adapter)

    def _read_publication(self, record: TenantRecord, version: int | None) -> Local:
        """The publication, its adapter copied (sha256-verified) into this server's private cache for vLLM."""
        fs, root = self.storage.open(record.output_dir)
        p = locate(fs, root, version, self.backbone)
        if not p.lora:
            return Local(p.version, p.directory, None)
        config = read_verified(fs, p.directory, ADAPTER_CONFIG, p.manifest)
        rank, limit = int(json.loads(config)["r"]), self.settings.shared.max_lora_rank
        if rank > limit:
            raise Unfit(f"{p.directory}: LoRA rank {rank} is over this deployment's max_lora_rank {limit}")
        dest = self.cache / "tenants" / record.name / f"a{record.attempt}" / f"step={p.version:06d}"
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, data in (
            (ADAPTER_FILE, read_verified(fs, p.directory, ADAPTER_FILE, p.manifest)),
            (ADAPTER_CONFIG, config),
        ):
            tmp = dest / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dest / name)
        return Local(p.version, p.directory, str(dest))

    async def _apply(self, tenant: Tenant, local: Local) -> int:
        """Load the adapter on every server, switch the tenant to it, unload the one it replaced (one switch of a
        tenant at a time: a poll's load and an update may overlap)."""
        async with self.switching.setdefault(tenant.lease, asyncio.Lock()):
            old = self.served.get(tenant.lease)
            if old is not None and old.version >= local.version:
                return old.version
            name = f"{tenant.record.name}-{local.version}-a{tenant.record.attempt}"
            if local.path is not None:
                await self._load_everywhere(name, local.path)
            if self.tenants.get(tenant.record.name) is not tenant:  # it left while loading
                await self._retire(name if local.path else None)
                raise BackendError(410, f"tenant {tenant.record.name!r} left the shared deployment")
            self.served[tenant.lease] = Served(local.version, name if local.path else None, name)
            if old is not None:
                await self._retire(old.adapter)
            return local.version

    def served_version(self, tenant: Tenant) -> int:
        served = self.served.get(tenant.lease)
        return -1 if served is None else served.version

    async def _load_everywhere(self, name: str, path: str) -> None:
        # in place: the same name is the same verified bytes (a record removed and added again, same attempt)
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        for server in self.up.servers:
            r = await self.client.post(server + "/v1/load_lora_adapter", json=body)
            if 400 <= r.status_code < 500:  # vLLM cannot serve this adapter (rank, modules): never will
                raise Unfit(f"{path}: {upstream_error(r).message}")
            if r.status_code != 200:
                raise OSError(f"{server}: loading LoRA adapter {name}: HTTP {r.status_code}: {r.text[:300]}")
        self.loaded.add(name)

    async def _retire(self, adapter: str | None) -> None:
        if adapter is None:
            return
        if self.running[adapter] > 0:
            self.retired.add(adapter)
            return
        self.retired.discard(adapter)
        self.running.pop(adapter, None)
        self.loaded.discard(adapter)
        for server in self.up.servers:
            try:
                r = await self.client.post(server + "/v1/unload_lora_adapter", json={"lora_name": adapter})
            except httpx.TransportError as exc:
                log.warning(f"unloading LoRA adapter {adapter} from {server}: {exc!r}")
                continue
            if r.status_code != 200:
                log.warning(f"unloading LoRA adapter {adapter} from {server}: HTTP {r.status_code}: {r.text[:300]}")

    # -- generation ---------------------------------------------------------------------------------------

    def _pin(self, gen: Generation) -> tuple[int, dict[str, Any]]:
        served = self.served[self.tenant_for(gen.tenant).lease]
        if served.adapter is not None:
            self.running[served.adapter] += 1
        self.held[gen.id] = served.adapter
        return served.version, {"model": served.adapter or self.model_name, "cache_salt": served.salt}

    def _end(self, start: int) -> int:
        return start  # vLLM keeps a request on the adapter it was admitted with

    async def _release(self, gen: Generation) -> None:
        adapter = self.held.pop(gen.id, None)
        if adapter is not None:
            self.running[adapter] -= 1
            if adapter in self.retired and self.running[adapter] == 0:
                await self._retire(adapter)

    def _still_served(self, gen: Generation, tenant: Tenant) -> None:
        if self.tenants.get(tenant.record.name) is not tenant:
            raise BackendError(410, f"tenant {tenant.record.name!r} left the shared deployment while its request ran")

    async def generate(self, gen: Generation) -> Body:
        tenant = self.tenant_for(gen.tenant)
        try:
            out = await super().generate(gen)
        finally:
            await self._release(gen)
        self._still_served(gen, tenant)
        assert isinstance(out, dict)
        out["model"] = tenant.record.name
        return out

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        tenant = self.tenant_for(gen.tenant)
        try:
            async for chunk in super().stream(gen):
                chunk["model"] = tenant.record.name
                yield chunk
        finally:
            await self._release(gen)
        self._still_served(gen, tenant)

    # -- health and updates -------------------------------------------------------------------------------

    async def health(self) -> api.HealthResponse:
        h = await super().health()
        stats = {**h.stats, "tenants": len(self.tenants), "tenants_refused": len(self.refused)}
        stats["lora_adapters"] = len(self.loaded)  # one per tenant, plus replaced ones whose requests still run
        return api.HealthResponse(status="ok", policy_version=0, stats=stats, tenants=self.tenant_versions())

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        try:
            return await self.update_tenant(req)
        except Unfit as exc:  # vLLM refused the adapter
            raise BackendError(422, str(exc)) from None
        except (httpx.TransportError, OSError) as exc:
            raise BackendError(503, f"loading the adapter into vLLM failed: {exc!r}") from None

    async def close(self) -> None:
        self.stop_polling()
        await super().close()


async def _no_full_updates(version: int) -> str:
    raise BackendError(400, "a shared server loads tenants' adapters, not full publications")


async def create(cfg) -> SharedVLLMBackend:
    """The shared server on vLLM: DEPLOY_DIR's backbone (version 0) served with LoRA enabled, tenants polled."""
    from engines.inference.backend import served_name
    from engines.inference.vllm import processes
    from engines.inference.vllm.backend import start_servers
    from storage import weights
    from storage.fs import Storage, read_manifest

    settings: SharedInferenceSettings = cfg.shared
    if cfg.weight_broadcast.type != "filesystem":
        raise SystemExit("a shared deployment's tenants publish adapters: it takes weight_broadcast.type = filesystem")
    storage = Storage(cfg.run.storage)
    fs, root = storage.open(cfg.run.output_dir)
    backbone = str(read_manifest(fs, weights.version_dir(root, 0))["model_sha256"])
    cache = processes.cache_dir(cfg.run.run_id)
    model_dir = processes.materialize(fs, root, 0, cache)
    inference = cfg.inference.model_copy(deep=True)
    inference.vllm.vllm_extra = {**inference.vllm.vllm_extra, **lora_flags(settings)}
    inference.vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    up, client, procs = start_servers(cfg, inference, Path(str(model_dir)), 0)
    backend = SharedVLLMBackend(up, client, served_name(cfg), cfg.model.max_seq_len, procs, cache)
    backend._init_gate(settings, storage, backbone)
    backend.start()
    log.info(f"shared vLLM server on backbone {backbone[:12]}, up to {settings.shared.max_tenants} tenants")
    return backend
