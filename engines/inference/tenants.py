"""A shared deployment's tenant table and gate (docs/multitenant.md), common to every backend that serves tenants
(the embedded engine's adapter slots: embedded/shared.py; vLLM's LoRA adapters: vllm/shared.py).

    DEPLOY_DIR/tenants/<name>.json  --poll every shared.poll_s-->  join (a slot) / leave / load its newest publication
    request (model = tenant, Bearer <tenant token>)  -> authorize -> the backend serves it with the tenant's adapter
    /update_weights {tenant, version} (the tenant's token) -> that tenant's publication -> the backend applies it

A tenant joins when its record appears (a free slot, else it is refused until one frees: max_tenants), leaves when
its record goes, and a higher `attempt` (a resume) leaves and joins again from its newest publication. A publication
this deployment can never serve (`Unfit`: another base, a rank over max_lora_rank, a layer the backbone lacks)
refuses the tenant for that attempt (logged, its requests answered 403 with the reason, `tenants_refused` in /health);
the others are unaffected. Tokens are checked by SHA-256 against the record (hmac.compare_digest).

A backend mixes `TenantGate` in and supplies the hooks: `_opened` / `_closed` (a tenant's slot),
`_read_publication` (a publication of the tenant's OUTPUT_DIR, in a thread), `_apply` (serve it; returns the version
now served) and `served_version`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from config.tenant import SharedInferenceSettings, TenantRecord
from engines import protocol as api
from engines.inference.backend import BackendError, TenantAuth
from storage import weights
from storage.fs import CorruptError, is_committed, read_manifest

log = logging.getLogger("rollflow.inference.shared")


class Unfit(ValueError):
    """A publication this shared deployment cannot serve; the message says why."""


class NotPublished(LookupError):
    """No committed publication (at that version) in the tenant's OUTPUT_DIR yet."""


@dataclass
class Publication:
    """A tenant's publication as found: its version, directory and manifest; `lora`: an adapter (else version 0,
    the tenant's copy of the backbone)."""

    version: int
    directory: str
    manifest: dict[str, Any]
    lora: bool


def locate(fs, root: str, version: int | None, backbone: str) -> Publication:
    """Publication `version` (None: the newest committed) of the tenant run at `root`, whose base must be the
    backbone (model_sha256 `backbone`)."""
    if version is None:
        version = weights.latest_version(fs, root)
        if version is None:
            raise NotPublished(f"no committed publication under {weights.weights_root(root)} yet")
    directory = weights.version_dir(root, version)
    if not is_committed(fs, directory):
        raise NotPublished(f"no committed publication at {directory}")
    manifest = read_manifest(fs, directory)
    served = int(manifest["version"])
    if manifest.get("encoding") != "lora":
        if manifest.get("model_sha256") != backbone:
            raise Unfit(
                f"{directory}: a full publication whose model_sha256 {manifest.get('model_sha256')} is not the "
                f"deployment's backbone {backbone} (a tenant publishes LoRA adapters on the backbone)"
            )
        return Publication(served, directory, manifest, lora=False)
    base = manifest["lora_base"]["model_sha256"]
    if base != backbone:
        raise Unfit(f"{directory}: its adapter applies to base model_sha256 {base}, not this deployment's {backbone}")
    return Publication(served, directory, manifest, lora=True)


@dataclass
class Tenant:
    record: TenantRecord
    slot: int
    lease: int
    problem: str | None = None  # why its adapter is not loaded yet (retried every poll)


class TenantGate:
    """The tenant table, its poll, the gate and /update_weights of a shared server (mixed into a Backend)."""

    tenant_auth: TenantAuth | None

    def _init_gate(self, settings: SharedInferenceSettings, storage, backbone: str) -> None:
        self.storage, self.settings, self.backbone = storage, settings, backbone
        self.tenants: dict[str, Tenant] = {}
        self.refused: dict[str, tuple[TenantRecord, str, bool]] = {}  # name -> (record, why, for good this attempt)
        self.tenant_auth = self
        self._leases = itertools.count(1)
        self._lock = asyncio.Lock()  # one change of the tenant table at a time (poll, update)
        self._poller: asyncio.Task | None = None

    # -- the backend's hooks -------------------------------------------------------------------------------

    async def _opened(self, tenant: Tenant) -> None:
        """A tenant joined on `tenant.slot`."""

    async def _closed(self, tenant: Tenant, why: str) -> None:
        """A tenant left: its slot is free, its queued and running requests end with 410 (`why`)."""

    def _read_publication(self, record: TenantRecord, version: int | None) -> Any:
        """Publication `version` (None: newest) of the tenant, read and checked (a thread); has `.version` and
        `.directory`. Raises NotPublished, Unfit, CorruptError."""
        raise NotImplementedError

    async def _apply(self, tenant: Tenant, publication: Any) -> int:
        """Serve `publication` for the tenant; the version served now."""
        raise NotImplementedError

    def served_version(self, tenant: Tenant) -> int:
        """The tenant's served version, -1 before its first load."""
        raise NotImplementedError

    # -- the tenant table ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll())

    def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a bad poll (storage down) must not stop serving the tenants held
                log.warning(f"tenant refresh failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.settings.shared.poll_s)

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
                    await self._join(record)  # new, or refused for want of a slot: tried again
            for tenant in list(self.tenants.values()):
                if tenant.problem is not None:
                    await self._load(tenant)

    async def _join(self, record: TenantRecord) -> None:
        limit = self.settings.shared.max_tenants
        if len(self.tenants) >= limit:
            self._refuse(record, f"the deployment serves its max_tenants = {limit} tenants", permanent=False)
            return
        slot = min(set(range(1, limit + 1)) - {t.slot for t in self.tenants.values()})
        tenant = Tenant(record, slot, next(self._leases), problem="not loaded yet")
        await self._opened(tenant)
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
        await self._closed(tenant, why)
        log.info(f"{why}; slot {tenant.slot} freed")

    async def _load(self, tenant: Tenant) -> None:
        """Serve the tenant's newest publication; one that can never be served refuses the tenant."""
        name = tenant.record.name
        try:
            publication = await asyncio.to_thread(self._read_publication, tenant.record, None)
            await self._apply(tenant, publication)
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
        log.info(f"tenant {name!r} serves version {publication.version} ({publication.directory})")

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

    def tenant_for(self, name: str | None) -> Tenant:
        """The tenant a generation is for: 410 when it left, 503 before its first adapter is loaded."""
        tenant = self.tenants.get(name or "")
        if tenant is None:
            raise BackendError(410, f"tenant {name!r} left the shared deployment")
        if self.served_version(tenant) < 0:
            raise BackendError(503, f"tenant {name!r}: its adapter is not loaded yet ({tenant.problem})")
        return tenant

    def tenant_versions(self) -> dict[str, int]:
        return {name: self.served_version(t) for name, t in self.tenants.items()}

    async def update_tenant(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        """Tenant `req.tenant`'s publication `req.version`, from its own OUTPUT_DIR (never a path given here)."""
        if req.path is not None or req.tenant is None or req.version is None:
            raise BackendError(400, "a shared server takes `tenant` and `version` (no `path`)")
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            raise BackendError(410, f"tenant {req.tenant!r} left the shared deployment")
        t0 = time.perf_counter()
        try:
            publication = await asyncio.to_thread(self._read_publication, tenant.record, req.version)
        except NotPublished as exc:
            raise BackendError(404, str(exc)) from None
        except (Unfit, CorruptError) as exc:
            raise BackendError(422, str(exc)) from None
        served, p = self.served_version(tenant), publication
        if p.version < served:
            raise BackendError(409, f"{p.directory} holds version {p.version}, older than served {served}")
        t1 = time.perf_counter()
        version = await self._apply(tenant, p)
        tenant.problem = None
        return api.UpdateWeightsResponse(policy_version=version, load_s=t1 - t0, apply_s=time.perf_counter() - t1)
