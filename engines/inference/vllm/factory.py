"""The vLLM backend's factory (its BackendSpec's `create`): a shared deployment's server when the process config
has `shared` (shared.py), else the run's own vLLM servers (backend.py)."""

from __future__ import annotations

from engines.inference.vllm.backend import VLLMBackend


async def create(cfg) -> VLLMBackend:
    if getattr(cfg, "shared", None) is not None:
        from engines.inference.vllm import shared

        return await shared.create(cfg)
    from engines.inference.vllm import backend

    return await backend.create(cfg)
