"""The embedded backend's factory (its BackendSpec's `create`): a shared deployment's server when the process
config has `shared` (shared.py), else the run's own engine (backend.py)."""

from __future__ import annotations

from engines.inference.embedded.backend import EmbeddedBackend


async def create(cfg) -> EmbeddedBackend:
    if cfg.shared is not None:
        from engines.inference.embedded import shared

        return await shared.create(cfg)
    from engines.inference.embedded import backend

    return await backend.create(cfg)
