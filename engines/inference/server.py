"""Entry module of the inference process: `python -m engines.inference --config inference.json`.

Loads the latest published weights into the embedded `Engine` and serves:
  GET  /health, /v1/models, /openapi.json
  POST /v1/completions, /v1/chat/completions   (OpenAI-compatible, streaming on request; engines/inference/serving.py)
  POST /update_weights, /shutdown              (admin: `Authorization: Bearer $ROLLFLOW_ADMIN_TOKEN`)
Binds to 127.0.0.1 unless the config says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import time

from starlette.requests import Request  # light; FastAPI resolves route annotations from module globals

from engines import protocol as api

log = logging.getLogger("rollflow.inference")


ERRORS = {
    400: "invalid request: a malformed body, an unknown or unsupported field, or a request that cannot run "
    "(empty prompt, token ids outside the vocabulary, prompt + max_tokens over max_model_len, n over max_batch_size)",
    401: "admin route without the right bearer token",
    404: "unknown model name, or no committed publication at that version or path",
    409: "a publication older than the served version",
    422: "a corrupted publication or one that does not fit the model (the file or the tensors are named)",
}


def _errors(*codes: int) -> dict:
    """The OpenAPI `responses` entry of a route: each error it returns, in the OpenAI error shape."""
    return {c: {"model": api.ErrorResponse, "description": ERRORS[c]} for c in codes}


def install_error_handlers(app) -> None:
    """Every error in OpenAI's shape (`{"error": {message, type, param, code}}`, plus `detail`); a body that
    does not validate (unknown field, unsupported value) is a 400 naming the field, as OpenAI and vLLM answer."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}

    def body(code: int, message: str, param: str | None = None) -> JSONResponse:
        error = api.ErrorBody(message=message, type=kinds.get(code, "invalid_request_error"), param=param, code=code)
        return JSONResponse(api.ErrorResponse(error=error, detail=message).model_dump(), status_code=code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return body(exc.status_code, str(exc.detail))

    def openapi() -> dict:
        """FastAPI's document, without the 422 it adds for body validation (which is answered with 400 here)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema["paths"].values():
                for op in ops.values():
                    if op.get("responses", {}).get("422", {}).get("description") == "Validation Error":
                        del op["responses"]["422"]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        where = [".".join(str(x) for x in e.get("loc", ())[1:]) for e in exc.errors()]
        message = "; ".join(f"{w or 'body'}: {e['msg']}" for w, e in zip(where, exc.errors(), strict=True))
        return body(400, message, where[0] or None)


def build_app(engine, tokenizer, output_root_url: str, model_name: str, admin_token: str, storage=None, receiver=None):
    """The FastAPI app around an `Engine`; split from `main` so tests can serve it in-process. With a
    `receiver` (engines/weight_transport.py) an update takes the tensors the trainer sent for that version."""
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import StreamingResponse

    from engines.inference.serving import Serving
    from storage import weights
    from storage.fs import CorruptError, Storage, is_committed

    app = FastAPI(title="rollflow embedded inference")
    install_error_handlers(app)
    admin = Depends(api.admin_auth(admin_token))
    fs, root = (storage or Storage()).open(output_root_url)
    loaded: dict[str, dict] = {}  # the last publications loaded: a delta's base is not rebuilt each update
    serving = Serving(engine, tokenizer, model_name)
    started = int(time.time())

    def sse(prepared, http: Request):
        return StreamingResponse(serving.stream(prepared, http.is_disconnected), media_type="text/event-stream")

    @app.get("/health")
    def health() -> api.HealthResponse:
        return api.HealthResponse(status="ok", policy_version=engine.version, stats=engine.stats)

    @app.get("/v1/models")
    def models() -> api.ModelList:
        card = api.ModelCard(id=model_name, created=started, root=model_name, max_model_len=serving.max_model_len)
        return api.ModelList(data=[card])

    @app.post("/v1/completions", responses=_errors(400, 404))
    async def completions(req: api.CompletionRequest, http: Request) -> api.CompletionResponse:
        """Token ids or text in; with `stream=true` the answer is `text/event-stream` chunks instead."""
        ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        prepared = serving.prepare(req, ids, chat=False)
        if req.stream:
            return sse(prepared, http)  # type: ignore[return-value]
        return serving.completion(prepared, await serving.run(prepared, http.is_disconnected))

    @app.post("/v1/chat/completions", responses=_errors(400, 404))
    async def chat(req: api.ChatRequest, http: Request) -> api.ChatResponse:
        """Messages in (the tokenizer's chat template); with `stream=true`, `text/event-stream` chunks."""
        ids = tokenizer.render_messages([m.model_dump() for m in req.messages])
        prepared = serving.prepare(req, ids, chat=True)
        if req.stream:
            return sse(prepared, http)  # type: ignore[return-value]
        return serving.chat(prepared, await serving.run(prepared, http.is_disconnected))

    @app.post("/update_weights", dependencies=[admin], responses=_errors(400, 401, 404, 409, 422))
    async def update_weights(req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        t0 = time.perf_counter()
        directory = req.path or weights.version_dir(root, req.version or 0)
        if not await asyncio.to_thread(is_committed, fs, directory):
            raise HTTPException(status_code=404, detail=f"no committed weights at {directory}")
        try:
            version = await asyncio.to_thread(weights.read_version, fs, directory)
            if version < engine.version:
                raise HTTPException(409, f"{directory} holds version {version}, older than served {engine.version}")
            staged = await asyncio.to_thread(receiver.take, version) if receiver and req.version is not None else None
            state = staged if staged is not None else await asyncio.to_thread(weights.load, fs, directory, loaded)
            t1 = time.perf_counter()
            served = await asyncio.to_thread(engine.update_weights, state, version)
        except (CorruptError, ValueError) as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        return api.UpdateWeightsResponse(
            policy_version=served,
            load_s=t1 - t0,
            apply_s=time.perf_counter() - t1,
            source="collective" if staged is not None else "filesystem",
        )

    @app.post("/shutdown", dependencies=[admin], responses=_errors(401))
    async def shutdown() -> dict:
        if server := getattr(app.state, "server", None):
            server.should_exit = True
        return {"status": "shutting down"}

    return app


def load_engine(cfg, output_root_url: str, storage):
    """Build the model (engines/models/modeldir.py), load the newest committed weights, wrap them in an `Engine`."""
    import torch

    from engines.inference.embedded.engine import Engine
    from engines.models import lora, modeldir
    from storage import weights

    torch.set_num_threads(cfg.inference.num_threads)
    fs, root = storage.open(output_root_url)
    latest = weights.load_latest(fs, root)
    if latest is None:
        raise SystemExit(f"no committed weights under {weights.weights_root(output_root_url)}; run the warm-up first")
    loaded = modeldir.load(cfg.model, pretrained=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    lora.attach_to(model, cfg.model.lora)  # adapter publications carry base + adapter tensors
    version, state = latest
    model.load_published(state)
    # inference.dtype: the sampler may run in lower precision than the fp32 trainer (as vLLM serves bf16)
    model.to(getattr(torch, cfg.inference.dtype))
    inf = cfg.inference
    routes = inf.enable_return_routed_experts
    engine = Engine(model, version, tokenizer.eos_id, tokenizer.pad_id, inf.max_batch_size, cfg.seed, routes)
    return engine, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engines.inference", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved inference config (JSON)")
    args = parser.parse_args(argv)

    import uvicorn

    from config.process import InferenceProcessConfig
    from storage.fs import Storage, read_json

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = InferenceProcessConfig.model_validate(read_json(args.config))
    storage = Storage(cfg.run.storage)
    engine, tokenizer = load_engine(cfg, cfg.run.output_dir, storage)
    token = os.environ.get("ROLLFLOW_ADMIN_TOKEN") or secrets.token_hex(16)
    receiver = None
    if cfg.weight_broadcast.type == "collective":
        from engines.weight_transport import Receiver

        receiver = Receiver(cfg.weight_broadcast)
        log.info(f"weight transport: group store on {cfg.weight_broadcast.host}:{cfg.weight_broadcast.port}")
    name = f"rollflow/{cfg.run.run_id}"
    app = build_app(engine, tokenizer, cfg.run.output_dir, name, token, storage, receiver)
    # Keep-alive longer than the client's (httpx: 5 s): with equal timeouts a request can reuse a connection
    # the server is closing at that moment and fail with a ReadError after a few idle seconds.
    config = uvicorn.Config(
        app, host=cfg.inference.host, port=cfg.inference.port, log_level="warning", timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    app.state.server = server  # /shutdown sets server.should_exit
    log.info(f"serving policy version {engine.version} on http://{cfg.inference.host}:{cfg.inference.port}")
    server.run()
    engine.stop()
    if receiver is not None:
        receiver.stop()
