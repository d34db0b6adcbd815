"""Entry module of the inference process, for every backend: `python -m engines.inference --config inference.json`.

    inference.json (InferenceProcessConfig) -> inference.backend's declaration (engines/inference/backend.py,
    resolved by engines/registry.py: rollflow's own or an installed package's entry point)
    -> its capabilities checked against the settings -> the backend built (weights loaded, upstream started)
    -> the front end (engines/inference/frontend.py) on inference.host:inference.port until /shutdown, a
    signal, or the backend's `watch` ending (then the exit code is 1, so the flow restarts inference).

Binds to 127.0.0.1 unless the config says otherwise; the admin routes take `Authorization: Bearer <token>`
with the token from the environment (engines/protocol.py ADMIN_TOKEN_ENV), else a random one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys

from config.process import InferenceProcessConfig
from engines.entry import exit_done, read_process_config
from engines.heartbeat import heartbeat
from engines.inference import backend as backends
from engines.protocol import ADMIN_TOKEN_ENV
from engines.registry import PluginError

log = logging.getLogger("rollflow.inference")


async def serve(cfg: InferenceProcessConfig) -> bool:
    """Build the backend and serve it; True when the backend failed (its `watch` ended)."""
    beat = heartbeat()
    beat.server = True  # idle while it holds no request: only held work is judged (engines/heartbeat.py)
    beats = asyncio.create_task(beat.run())  # from the event loop: a blocked loop stops the heartbeat too
    try:
        return await _serve(cfg)
    finally:
        beats.cancel()


async def _serve(cfg: InferenceProcessConfig) -> bool:
    import uvicorn

    from engines.inference.frontend import Settings, build_app

    backend = await backends.create(cfg)
    try:
        inf = cfg.inference
        settings = Settings(
            os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16),
            inf.vllm.router.session_header,
            max_in_flight=inf.max_queued_requests,
            max_tokens=inf.queued_tokens(backend.max_model_len),
            retry_after_s=inf.retry_after_s,
        )
        app = build_app(backend, settings)
        # Keep-alive longer than the client's (httpx: 5 s): with equal timeouts a request can reuse a connection
        # the server is closing at that moment and fail with a ReadError after a few idle seconds. A bounded
        # graceful shutdown: a hung upstream call must not keep the process alive.
        config = uvicorn.Config(
            app, host=cfg.inference.host, port=cfg.inference.port, log_level="warning",
            timeout_keep_alive=60, timeout_graceful_shutdown=5,
        )  # fmt: skip
        server = uvicorn.Server(config)
        app.state.server = server  # /shutdown sets server.should_exit
        log.info(f"serving {backend.model_name} ({cfg.inference.backend}) on {cfg.inference.host}:{cfg.inference.port}")
        return await until_failed(server, backend)
    finally:
        await backend.close()


async def until_failed(server, backend: backends.Backend) -> bool:
    """Run the server; stop it when the backend's `watch` ends. True when that is why it stopped."""
    watcher = asyncio.ensure_future(backend.watch())
    watcher.add_done_callback(lambda _: setattr(server, "should_exit", True))
    try:
        await server.serve()
    finally:
        failed = watcher.done() and not watcher.cancelled()
        watcher.cancel()
    if failed and (exc := watcher.exception()) is not None:
        log.error(f"the inference backend failed: {type(exc).__name__}: {exc}")
    return failed


def main(argv: list[str] | None = None) -> None:
    cfg = InferenceProcessConfig.model_validate(read_process_config("engines.inference", __doc__, argv))
    try:
        backends.check(cfg.inference, cfg.weight_broadcast)
        if cfg.shared is not None:
            backends.check_shared(cfg.inference.backend)
    except PluginError as exc:
        raise SystemExit(str(exc)) from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the backend's close() runs
    try:
        failed = asyncio.run(serve(cfg))
    except SystemExit as stop:  # the signal, or a refusal on the way up: the backend is closed either way
        exit_done(stop.code)
    exit_done(1 if failed else 0)
