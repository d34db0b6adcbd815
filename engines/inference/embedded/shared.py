"""The shared deployment's inference server (docs/multitenant.md): one backbone, every tenant's adapter in one batch.

    DEPLOY_DIR/weights/step=000000 (the backbone, served as is) + a model with adapter slots (lora.attach_slots)
    DEPLOY_DIR/tenants/<name>.json  --poll every shared.poll_s-->  a slot per tenant, its newest publication loaded
    request (model = tenant, Bearer <tenant token>)  -> the tenant's slot and lease -> the engine's shared batch
    /update_weights {tenant, version} (the tenant's token) -> that tenant's publication -> its slot, between steps

A tenant joins when its record appears (a free slot, else it is refused until one frees: max_tenants), leaves when
its record goes (its queued and running requests fail with 410, nobody else's), and a higher `attempt` (a resume)
leaves and joins again from its newest publication. A tenant whose publication cannot be served here (another base,
a rank over max_lora_rank, a layer the backbone lacks: tenants.py `Unfit`) is refused for that attempt and
reported (logged, its requests answered 403 with the reason, `tenants_refused` in /health's stats); the others are
unaffected. Tokens are checked by SHA-256 against the record (hmac.compare_digest); a tenant sees only its own slot.
The engine keeps no KV across requests, so no cache is shared across tenants or versions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from config.tenant import SharedInferenceSettings, TenantRecord
from engines import protocol as api
from engines.inference.backend import BackendError, Body, Generation
from engines.inference.embedded.adapters import read_adapter
from engines.inference.embedded.backend import EmbeddedBackend
from engines.inference.embedded.engine import TenantGone
from engines.inference.embedded.serving import Prepared
from engines.inference.tenants import Tenant, TenantGate

log = logging.getLogger("rollflow.inference.shared")


class SharedBackend(TenantGate, EmbeddedBackend):
    def __init__(self, engine, tokenizer, fs, root, storage, settings: SharedInferenceSettings, backbone: str):
        super().__init__(engine, tokenizer, "rollflow/shared", fs, root)
        self._init_gate(settings, storage, backbone)

    # -- the tenant table's hooks (engines/inference/tenants.py) ----------------------------------------

    async def _opened(self, tenant: Tenant) -> None:
        self.engine.open_slot(tenant.slot, tenant.lease)

    async def _closed(self, tenant: Tenant, why: str) -> None:
        await asyncio.to_thread(self.engine.close_slot, tenant.slot, TenantGone(why))

    def _read_publication(self, record: TenantRecord, version: int | None):
        fs, root = self.storage.open(record.output_dir)
        rank = self.settings.shared.max_lora_rank
        return read_adapter(fs, root, version, self.engine.model, self.backbone, rank)

    async def _apply(self, tenant: Tenant, adapter) -> int:
        update = self.engine.update_slot
        return await asyncio.to_thread(
            update, tenant.slot, tenant.lease, adapter.tensors, adapter.scaling, adapter.version
        )

    def served_version(self, tenant: Tenant) -> int:
        return self.engine.slot_versions.get(tenant.slot, -1)

    # -- the backend --------------------------------------------------------------------------------------

    async def _prepare(self, gen: Generation) -> Prepared:
        tenant = self.tenant_for(gen.tenant)
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
        stats = {**self.engine.stats, "tenants": len(self.tenants), "tenants_refused": len(self.refused)}
        return api.HealthResponse(
            status="ok", policy_version=self.engine.version, stats=stats, tenants=self.tenant_versions()
        )

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        try:
            return await self.update_tenant(req)
        except TenantGone as exc:
            raise BackendError(410, str(exc)) from None

    async def close(self) -> None:
        self.stop_polling()
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
