"""Entry module of the inference process: `python -m engines.inference --config inference.json`.

Loads the latest published weights into the embedded `Engine` and serves:
  GET  /health, /v1/models
  POST /v1/completions, /v1/chat/completions   (OpenAI-compatible; token ids and logprobs on request)
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
import uuid

from engines.inference import api

log = logging.getLogger("rollflow.inference")


def build_app(engine, tokenizer, output_root_url: str, model_name: str, admin_token: str, storage=None, receiver=None):
    """The FastAPI app around an `Engine`; split from `main` so tests can serve it in-process. With a
    `receiver` (engines/weight_transport.py) an update takes the tensors the trainer sent for that version."""
    from fastapi import Depends, FastAPI, HTTPException

    from storage import weights
    from storage.fs import CorruptError, Storage, is_committed

    app = FastAPI(title="rollflow embedded inference")
    admin = Depends(api.admin_auth(admin_token))
    fs, root = (storage or Storage()).open(output_root_url)
    loaded: dict[str, dict] = {}  # the last publications loaded: a delta's base is not rebuilt each update

    async def sample(prompt_ids: list[int], n: int, max_tokens: int, temperature: float, seed: int | None):
        from engines.inference.engine import Request

        fut = engine.submit(Request(prompt_ids, n, max_tokens, temperature, seed))
        return await asyncio.wrap_future(fut)

    def usage(prompt_ids, outs) -> api.Usage:
        done = sum(len(c.token_ids) for c in outs)
        return api.Usage(prompt_tokens=len(prompt_ids), completion_tokens=done, total_tokens=len(prompt_ids) + done)

    def routes(c) -> list[list[list[int]]] | None:
        return None if c.routed_experts is None else c.routed_experts.tolist()

    def check_request(ids: list[int], max_tokens: int, n: int) -> None:
        """Refuse (400) what would fail or blow up inside a shared batch, before it is queued."""
        cfg = engine.model.cfg
        problem = None
        if not ids:
            problem = "prompt is empty"
        elif min(ids) < 0 or max(ids) >= engine.model.vocab_size:
            problem = f"prompt token ids must be in [0, {engine.model.vocab_size})"
        elif len(ids) + max_tokens > cfg.max_seq_len:
            problem = f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len {cfg.max_seq_len}"
        elif n > engine.max_batch_size:
            problem = f"n={n} exceeds the engine's max_batch_size {engine.max_batch_size}"
        if problem:
            raise HTTPException(status_code=400, detail=problem)

    @app.get("/health")
    def health() -> api.HealthResponse:
        return api.HealthResponse(status="ok", policy_version=engine.version, stats=engine.stats)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "rollflow"}]}

    @app.post("/v1/completions")
    async def completions(req: api.CompletionRequest) -> api.CompletionResponse:
        ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        check_request(ids, req.max_tokens, req.n)
        outs = await sample(ids, req.n, req.max_tokens, req.temperature, req.seed)
        choices = [
            api.CompletionChoice(
                index=i,
                text=tokenizer.decode(c.token_ids),
                finish_reason=c.finish_reason,
                logprobs=api.CompletionLogprobs(
                    tokens=[tokenizer.decode([t], skip_special=False) for t in c.token_ids],
                    token_logprobs=c.logprobs,
                )
                if req.logprobs is not None
                else None,
                token_ids=c.token_ids if req.return_token_ids else None,
                policy_version=c.policy_version,
                policy_version_end=c.policy_version_end,
                routed_experts=routes(c),
            )
            for i, c in enumerate(outs)
        ]
        return api.CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=usage(ids, outs),
        )

    @app.post("/v1/chat/completions")
    async def chat(req: api.ChatRequest) -> api.ChatResponse:
        ids = tokenizer.render_messages([m.model_dump() for m in req.messages])
        check_request(ids, req.max_tokens, req.n)
        outs = await sample(ids, req.n, req.max_tokens, req.temperature, req.seed)
        choices = []
        for i, c in enumerate(outs):
            lps = [
                api.ChatLogprob(token=tokenizer.decode([t], skip_special=False), logprob=lp)
                for t, lp in zip(c.token_ids, c.logprobs, strict=True)
            ]
            choices.append(
                api.ChatChoice(
                    index=i,
                    message=api.ChatMessage(role="assistant", content=tokenizer.decode(c.token_ids)),
                    finish_reason=c.finish_reason,
                    logprobs=api.ChatChoiceLogprobs(content=lps) if req.logprobs else None,
                    token_ids=c.token_ids if req.return_token_ids else None,
                    policy_version=c.policy_version,
                    policy_version_end=c.policy_version_end,
                    routed_experts=routes(c),
                )
            )
        return api.ChatResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=usage(ids, outs),
        )

    @app.post("/update_weights", dependencies=[admin])
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

    @app.post("/shutdown", dependencies=[admin])
    async def shutdown() -> dict:
        if server := getattr(app.state, "server", None):
            server.should_exit = True
        return {"status": "shutting down"}

    return app


def load_engine(cfg, output_root_url: str, storage):
    """Build the model (engines/modeldir.py), load the newest committed weights, wrap them in an `Engine`."""
    import torch

    from engines import lora, modeldir
    from engines.inference.engine import Engine
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
