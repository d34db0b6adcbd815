"""The embedded backend with `update_weights` to version $HANG_UPDATE_AT hanging the first time (see __init__)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from engines.inference.embedded.backend import create as create_embedded


async def create(cfg):
    backend = await create_embedded(cfg)
    hang_at = int(os.environ.get("HANG_UPDATE_AT", "3"))
    marker = Path(cfg.run.output_dir) / "hung-update"
    update = backend.update_weights

    async def update_weights(req):
        if req.version == hang_at and not marker.exists():
            marker.write_text(f"version {hang_at}\n")
            print(f"hanging the update to version {hang_at}", flush=True)
            await asyncio.Event().wait()  # never set: the request is held until the process is stopped
        return await update(req)

    backend.update_weights = update_weights
    return backend
