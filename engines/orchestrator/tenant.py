"""The orchestrator as a tenant of a shared deployment (docs/multitenant.md; OrchestratorProcessConfig.tenant).

The shared server tells tenants apart by the request's `model` (the tenant's name) and admits one only with
its bearer token (TENANT_TOKEN_ENV, whose SHA-256 the tenant's record holds). `TenantClient` puts both on every
request the orchestrator sends, whichever path sends it (groups, episodes, evaluations, environments that
sample through it): the token as a default header, `model` in every inference API body (`/v1/...`). The
weight sync follows the tenant's own version (`HealthResponse.tenants[tenant]`) and names the tenant in its
updates (engines/orchestrator/loop.py WeightSync).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx

from config.tenant import TENANT_TOKEN_ENV
from engines.protocol import HealthResponse


class TenantClient(httpx.AsyncClient):
    """An AsyncClient whose every request is the tenant's."""

    def __init__(self, tenant: str, token: str, **kwargs: Any):
        super().__init__(headers={"Authorization": f"Bearer {token}"}, **kwargs)
        self.tenant = tenant

    async def post(self, url: httpx.URL | str, *, json: Any = None, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        if isinstance(json, dict) and str(url).startswith("/v1/"):
            json = {**json, "model": self.tenant}
        return await super().post(url, json=json, **kwargs)


def tenant_token() -> str:
    token = os.environ.get(TENANT_TOKEN_ENV, "")
    if not token:
        raise RuntimeError(f"a tenant orchestrator needs its token in {TENANT_TOKEN_ENV} (the tenant flow sets it)")
    return token


def tenant_version(health: HealthResponse, tenant: str) -> int | None:
    """The tenant's served adapter version (-1: registered, none loaded yet); None: not registered."""
    return (health.tenants or {}).get(tenant)


async def wait_registered(client: httpx.AsyncClient, tenant: str, timeout_s: float) -> None:
    """Until the shared server lists the tenant in /health (it polls D/tenants/ every shared.poll_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await client.get("/health")
        if r.status_code == 200 and tenant_version(HealthResponse.model_validate_json(r.content), tenant) is not None:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the shared server at {client.base_url} has not registered tenant {tenant!r} after {timeout_s}s "
                "(its log says why: max_tenants reached, another backbone, a bad record)"
            )
        await asyncio.sleep(0.2)
