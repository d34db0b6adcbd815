"""The shared deployment's inference server (docs/multitenant.md): one backbone, every tenant's adapter in one batch.

    DEPLOY_DIR/weights/step=000000 (the backbone, served as is) + a model with adapter slots (lora.attach_slots)
    DEPLOY_DIR/tenants/<name>.json  --poll every shared.poll_s-->  a slot per tenant, its newest publication loaded
    request (model = tenant, Bearer <tenant token>)  -> the tenant's slot and lease -> the engine's shared batch
    /update_weights {tenant, version} (the tenant's token) -> that tenant's publication -> its slot, between steps

A tenant joins when its record appears (a free slot, else it is refused until one frees: max_tenants), leaves when
its record goes (its queued and running requests fail with 410, nobody else's), and a higher `attempt` (a resume)
leaves and joins again from its newest publication. A tenant whose publication cannot be served here (another base,
a rank over max_lora_rank, a layer the backbone lacks: adapters.py `Unfit`) is refused for that attempt and
reported (logged, its requests answered 403 with the reason, `tenants_refused` in /health's stats); the others are
unaffected. Tokens are checked by SHA-256 against the record (hmac.compare_digest); a tenant sees only its own slot.
The engine keeps no KV across requests, so no cache is shared across tenants or versions.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from config.tenant import SharedInferenceSettings, TenantRecord
from engines import protocol as api
from engines.inference.backend import BackendError, Body, Generation
from engines.inference.embedded.adapters import NotPublished, Unfit, read_adapter
from engines.inference.embedded.backend import EmbeddedBackend
from engines.inference.embedded.engine import TenantGone
from engines.inference.embedded.serving import Prepared
from storage.fs import CorruptError

log = logging.getLogger("rollflow.inference.shared")


@dataclass
class Tenant:
    record: TenantRecord
    slot: int
    lease: int
    problem: str | None = None  # why its adapter is not loaded yet (retried every poll)


class SharedBackend(EmbeddedBackend):
    def __init__(self, engine, tokenizer, fs, root, storage, settings: SharedInferenceSettings, backbone: str):
        super().__init__(engine, tokenizer, "rollflow/shared", fs, root)
        self.storage, self.settings, self.backbone = storage, settings, backbone
        self.tenants: dict[str, Tenant] = {}
        self.refused: dict[str, tuple[TenantRecord, str, bool]] = {}  # name -> (record, why, for good this attempt)
        self.tenant_auth = self
        self._leases = itertools.count(1)
        self._lock = asyncio.Lock()  # one change of the tenant table at a time (poll, update)
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a bad poll (storage down) must not stop serving the tenants held
                log.warning(f"tenant refresh failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.settings.shared.poll_s)

    # -- the tenant table ---------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Follow DEPLOY_DIR/tenants/: leave the removed and restarted, join the new, load what is not loaded."""
        from storage.tenants import read_tenants

        records, _ = await asyncio.to_thread(read_tenants, self.settings.deploy_dir)
        async with self._lock:
            for name, held in list(self.tenants.items()):
                record = records.get(name)
                if record is None or record.attempt > held.record.attempt:
                    why = "its record was removed" if record is None else f"attempt {record.attempt} started"
                    await self._leave(name, f"tenant {name!r} left the shared deployment: {why}")
            for name, (record, _, _) in list(self.refused.items()):
                now = records.get(name)
                if now is None or now.attempt > record.attempt:
                    del self.refused[name]
            for name, record in records.items():
                if name not in self.tenants and not (name in self.refused and self.refused[name][2]):
                    self._join(record)  # new, or refused for want of a slot: tried again
            for tenant in list(self.tenants.values()):
                if tenant.problem is not None:
                    await self._load(tenant)

    def _join(self, record: TenantRecord) -> None:
        limit = self.settings.shared.max_tenants
        if len(self.tenants) >= limit:
            self._refuse(record, f"the deployment serves its max_tenants = {limit} tenants", permanent=False)
            return
        slot = min(set(range(1, limit + 1)) - {t.slot for t in self.tenants.values()})
        tenant = Tenant(record, slot, next(self._leases), problem="not loaded yet")
        self.engine.open_slot(slot, tenant.lease)
        self.tenants[record.name] = tenant
        self.refused.pop(record.name, None)
        log.info(f"tenant {record.name!r} (attempt {record.attempt}) joined on slot {slot}")

    def _refuse(self, record: TenantRecord, why: str, permanent: bool) -> None:
        known = self.refused.get(record.name)
        if known is None or known[1] != why:
            log.warning(f"tenant {record.name!r} (attempt {record.attempt}) refused: {why}")
        self.refused[record.name] = (record, why, permanent)

    async def _leave(self, name: str, why: str) -> None:
        tenant = self.tenants.pop(name)
        await asyncio.to_thread(self.engine.close_slot, tenant.slot, TenantGone(why))
        log.info(f"{why}; slot {tenant.slot} freed")

    async def _load(self, tenant: Tenant) -> None:
        """Serve the tenant's newest publication; one that can never be served refuses the tenant."""
        name = tenant.record.name
        try:
            adapter = await asyncio.to_thread(self._read_adapter, tenant.record, None)
            await asyncio.to_thread(self._apply, tenant, adapter)
        except Unfit as exc:
            await self._leave(name, f"tenant {name!r} refused: {exc}")
            self._refuse(tenant.record, str(exc), permanent=True)
            return
        except (NotPublished, CorruptError, OSError, ValueError) as exc:
            if tenant.problem != str(exc):
                log.warning(f"tenant {name!r}: adapter not loaded ({exc}); retrying every poll")
            tenant.problem = str(exc)
            return
        tenant.problem = None
        log.info(f"tenant {name!r} serves version {adapter.version} ({adapter.directory})")

    def _read_adapter(self, record: TenantRecord, version: int | None):
        fs, root = self.storage.open(record.output_dir)
        rank = self.settings.shared.max_lora_rank
        return read_adapter(fs, root, version, self.engine.model, self.backbone, rank)

    def _apply(self, tenant: Tenant, adapter) -> int:
        return self.engine.update_slot(tenant.slot, tenant.lease, adapter.tensors, adapter.scaling, adapter.version)

    # -- the gate (front end) -----------------------------------------------------------------------------

    def authorize(self, model: str | None, authorization: str | None) -> str:
        held = self.tenants.get(model or "")
        record = held.record if held else self.refused[model][0] if model in self.refused else None
        if model is None or record is None:
            raise BackendError(404, f"model {model!r} is no tenant of this shared deployment", "model")
        token = (authorization or "").removeprefix("Bearer ").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), record.token_sha256):
            raise BackendError(401, f"tenant {model!r}: missing or wrong bearer token")
        if held is None:
            raise BackendError(403, f"tenant {model!r} is refused by this shared deployment: {self.refused[model][1]}")
        return model

    def _slot_of(self, gen: Generation) -> Tenant:
        tenant = self.tenants.get(gen.tenant or "")
        if tenant is None:
            raise BackendError(410, f"tenant {gen.tenant!r} left the shared deployment")
        if self.engine.slot_versions.get(tenant.slot, -1) < 0:
            raise BackendError(503, f"tenant {gen.tenant!r}: its adapter is not loaded yet ({tenant.problem})")
        return tenant

    # -- the backend --------------------------------------------------------------------------------------

    async def _prepare(self, gen: Generation) -> Prepared:
        tenant = self._slot_of(gen)
        p = await super()._prepare(gen)
        p.request.slot, p.request.lease, p.model = tenant.slot, tenant.lease, tenant.record.name
        return p

    async def generate(self, gen: Generation) -> Body:
        try:
            return await super().generate(gen)
        except TenantGone as exc:
            raise BackendError(410, str(exc)) from None

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        try:
            async for chunk in super().stream(gen):
                yield chunk
        except TenantGone as exc:
            raise BackendError(410, str(exc)) from None

    async def health(self) -> api.HealthResponse:
        versions = {name: self.engine.slot_versions.get(t.slot, -1) for name, t in self.tenants.items()}
        stats = {**self.engine.stats, "tenants": len(self.tenants), "tenants_refused": len(self.refused)}
        return api.HealthResponse(status="ok", policy_version=self.engine.version, stats=stats, tenants=versions)

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        """Tenant `req.tenant`'s publication `req.version`, from its own OUTPUT_DIR (never a path given here)."""
        if req.path is not None or req.tenant is None or req.version is None:
            raise BackendError(400, "a shared server takes `tenant` and `version` (no `path`)")
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            raise BackendError(410, f"tenant {req.tenant!r} left the shared deployment")
        t0 = time.perf_counter()
        try:
            adapter = await asyncio.to_thread(self._read_adapter, tenant.record, req.version)
        except NotPublished as exc:
            raise BackendError(404, str(exc)) from None
        except (Unfit, CorruptError) as exc:
            raise BackendError(422, str(exc)) from None
        served = self.engine.slot_versions.get(tenant.slot, -1)
        if adapter.version < served:
            raise BackendError(409, f"{adapter.directory} holds version {adapter.version}, older than served {served}")
        t1 = time.perf_counter()
        try:
            version = await asyncio.to_thread(self._apply, tenant, adapter)
        except TenantGone as exc:
            raise BackendError(410, str(exc)) from None
        tenant.problem = None
        return api.UpdateWeightsResponse(policy_version=version, load_s=t1 - t0, apply_s=time.perf_counter() - t1)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await super().close()


async def create(cfg) -> SharedBackend:
    """The shared server of an InferenceProcessConfig with `shared`: the backbone (DEPLOY_DIR's version 0) with
    max_tenants + 1 adapter slots (slot 0: none), polling the tenant records from the start."""
    import torch

    from engines.inference.embedded.engine import Engine
    from engines.models import lora, modeldir
    from engines.models.vlm import is_vision
    from storage import weights
    from storage.fs import Storage, read_manifest

    settings: SharedInferenceSettings = cfg.shared
    if cfg.weight_broadcast.type != "filesystem":
        raise SystemExit("a shared deployment's tenants publish adapters: it takes weight_broadcast.type = filesystem")
    storage = Storage(cfg.run.storage)
    fs, root = storage.open(cfg.run.output_dir)
    torch.set_num_threads(cfg.inference.num_threads)
    loaded = modeldir.load(cfg.model.model_copy(update={"lora": None}), pretrained=False)
    model, tok = loaded.model, loaded.tokenizer
    if is_vision(model):
        raise SystemExit("a shared deployment serves text models only (its adapter slots take per-row inputs)")
    directory = weights.version_dir(root, 0)
    backbone = str(read_manifest(fs, directory)["model_sha256"])
    model.load_published(weights.load(fs, directory))
    try:
        lora.attach_slots(model, settings.shared.max_tenants + 1, settings.shared.max_lora_rank)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    model.to(getattr(torch, cfg.inference.dtype))
    inf = cfg.inference
    engine = Engine(model, 0, tok.eos_id, tok.pad_id, inf.max_batch_size, cfg.seed)
    backend = SharedBackend(engine, tok, fs, root, storage, settings, backbone)
    backend.start()
    log.info(f"shared server on backbone {directory} ({backbone[:12]}), up to {settings.shared.max_tenants} tenants")
    return backend
