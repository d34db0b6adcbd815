"""The inference HTTP API, written once over any `Backend` (engines/inference/backend.py).

    GET  /health, /v1/models, /openapi.json
    POST /v1/completions, /v1/chat/completions    OpenAI-compatible; `stream=true` answers server-sent events
    POST /update_weights, /shutdown               admin: `Authorization: Bearer <token>`

A request body is validated against engines/protocol.py (an unknown field or an unsupported value is a 400
naming it), bounded in size, and turned into a `Generation` (the configured session header's value, the
request id, the client's other x- headers); the backend answers it. Every error, the backend's included, has
OpenAI's shape (`{"error": {message, type, param, code}, "detail"}`), and OpenAPI lists each route's errors.
A client that goes away (checked every DISCONNECT_POLL_S while it waits, since a closed connection is not
always noticed on write) cancels its generation, which stops the backend's work on it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from engines import protocol as api
from engines.inference.backend import Backend, BackendError, Generation

DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 8 * 2**20  # far above any prompt of max_model_len tokens; a larger body is a 413
MAX_IN_FLIGHT = 1024  # generation requests served at once; one more is a 503 (the orchestrator sends <= 64)
REQUEST_ID_HEADER = "x-request-id"

ERRORS = {
    400: "invalid request: a malformed body, an unknown or unsupported field, or a request that cannot run "
    "(empty prompt, token ids outside the vocabulary, prompt + max_tokens over max_model_len, n over the batch)",
    401: "admin route without the right bearer token",
    404: "unknown model name, or no committed publication at that version or path",
    409: "a publication older than the served version",
    413: f"a request body over {MAX_BODY_BYTES} bytes",
    422: "a corrupted publication or one that does not fit the model (the file or the tensors are named)",
    503: f"the backend cannot serve now (an upstream server is down), or {MAX_IN_FLIGHT} requests are in flight",
}
KINDS = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 500: "internal_error",
         503: "service_unavailable_error"}  # fmt: skip
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    admin_token: str
    session_header: str = api.SESSION_HEADER  # inference.router.session_header: whose value names the session
    max_body_bytes: int = MAX_BODY_BYTES
    max_in_flight: int = MAX_IN_FLIGHT


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


def error_body(code: int, message: str, param: str | None = None) -> dict:
    error = api.ErrorBody(message=message, type=KINDS.get(code, "invalid_request_error"), param=param, code=code)
    return api.ErrorResponse(error=error, detail=message).model_dump()


def _errors(*codes: int) -> dict:
    """The OpenAPI `responses` entry of a route: each error it returns, in the OpenAI error shape."""
    return {c: {"model": api.ErrorResponse, "description": ERRORS[c]} for c in codes}


def admin_auth(token: str) -> Callable[..., None]:
    """The dependency of every admin route: `Authorization: Bearer <token>` or 401."""

    def check(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not secrets.compare_digest(authorization, f"Bearer {token}"):
            raise HTTPException(status_code=401, detail="admin route: missing or wrong bearer token")

    return check


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes fails with 413 when the route reads it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit or (declared is not None and declared.isdigit() and int(declared) > self.limit):
                raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        return await self.app(scope, bounded, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; a body that does not validate is a 400 naming the field (as OpenAI
    and vLLM answer), and the OpenAPI document drops the 422 FastAPI would list for it."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def reply(code: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(code, message, param), status_code=code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return reply(exc.status_code, str(exc.detail))

    @app.exception_handler(BackendError)
    async def backend_error(request, exc):
        return reply(exc.status, exc.message, exc.param)

    @app.exception_handler(Exception)
    async def internal(request, exc):  # still logged: Starlette re-raises it after answering
        return reply(500, f"{type(exc).__name__}: {exc}")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        where = [".".join(str(x) for x in e.get("loc", ())[1:]) for e in exc.errors()]
        message = "; ".join(f"{w or 'body'}: {e['msg']}" for w, e in zip(where, exc.errors(), strict=True))
        return reply(400, message, where[0] or None)

    def openapi() -> dict:
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


async def until_gone(work: Awaitable[T], gone: Callable[[], Awaitable[bool]]) -> T:
    """`work`'s result; cancelled (the backend stops) and ClientGone once the client has gone."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await gone():
                raise ClientGone
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


async def guarded(chunks: AsyncIterator[T], gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[T]:
    """`chunks` until they end or the client goes; closing them then stops the backend's work."""
    it = aiter(chunks)
    try:
        while True:
            try:
                chunk = await until_gone(anext(it), gone)
            except (StopAsyncIteration, ClientGone):
                return
            yield chunk
    finally:
        await it.aclose()  # type: ignore[attr-defined]


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def framed(first: dict | None, rest: AsyncIterator[dict], release: Callable[[], None]) -> AsyncIterator[str]:
    """The event stream: each chunk as `data: {json}`, then `data: [DONE]`; an error after the status line
    was sent goes in the stream as an error event."""
    try:
        if first is not None:
            yield sse(first)
        async for chunk in rest:
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    except BackendError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param))
    except Exception as exc:
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "internal_error", "code": 500}})
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
        release()


def generation(body: api.CompletionRequest | api.ChatRequest, headers, session_header: str) -> Generation:
    """The backend's view of a request: its session (the configured header), request id and x- headers."""
    session = headers.get(session_header)
    request_id = headers.get(REQUEST_ID_HEADER) or (f"{session}-{secrets.token_hex(4)}" if session else None)
    skip = {session_header.lower(), REQUEST_ID_HEADER}
    extra = {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-") and k.lower() not in skip}
    return Generation(body, session=session, request_id=request_id, headers=extra)


def _json(body: Any) -> Any:
    return body.model_dump(mode="json") if isinstance(body, BaseModel) else body


def build_app(backend: Backend, settings: Settings) -> FastAPI:
    """The app serving `backend`; `app.state.server`, when set, is the uvicorn server /shutdown stops."""
    app = FastAPI(title=f"rollflow inference ({type(backend).__name__})")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    admin = Depends(admin_auth(settings.admin_token))
    generate = _generation_route(backend, settings)
    started = int(time.time())

    @app.get("/health", responses=_errors(503))
    async def health() -> api.HealthResponse:
        return await backend.health()

    @app.get("/v1/models")
    def models() -> api.ModelList:
        name = backend.model_name
        return api.ModelList(
            data=[api.ModelCard(id=name, created=started, root=name, max_model_len=backend.max_model_len)]
        )

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=_errors(400, 404, 413, 503))
    async def completions(req: api.CompletionRequest, http: Request) -> Response:
        """Token ids or text in; with `stream=true` the answer is `text/event-stream` chunks instead."""
        return await generate(req, http)

    @app.post("/v1/chat/completions", response_model=api.ChatResponse, responses=_errors(400, 404, 413, 503))
    async def chat(req: api.ChatRequest, http: Request) -> Response:
        """Messages in (the chat template); with `stream=true`, `text/event-stream` chunks."""
        return await generate(req, http)

    @app.post("/update_weights", dependencies=[admin], responses=_errors(400, 401, 404, 409, 422, 503))
    async def update_weights(req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        return await backend.update_weights(req)

    @app.post("/shutdown", dependencies=[admin], responses=_errors(401))
    async def shutdown() -> dict:
        if server := getattr(app.state, "server", None):
            server.should_exit = True
        return {"status": "shutting down"}

    return app


def _generation_route(backend: Backend, settings: Settings):
    """What both generation routes do: check the model name, hold one of the in-flight slots, answer."""
    in_flight = 0

    def release() -> None:
        nonlocal in_flight
        in_flight -= 1

    async def answer(body: api.CompletionRequest | api.ChatRequest, http: Request) -> Response:
        nonlocal in_flight
        if body.model is not None and body.model != backend.model_name:
            raise HTTPException(404, f"model {body.model!r} does not exist: this server serves {backend.model_name!r}")
        if in_flight >= settings.max_in_flight:
            raise HTTPException(503, f"{in_flight} requests in flight (the most this server takes); retry later")
        in_flight += 1
        release_here = True
        try:
            gen = generation(body, http.headers, settings.session_header)
            if body.stream:
                response = await _stream(backend, gen, http, release)
                release_here = False  # the stream holds the slot until it ends
                return response
            return JSONResponse(_json(await until_gone(backend.generate(gen), http.is_disconnected)))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        finally:
            if release_here:
                release()

    return answer


async def _stream(backend: Backend, gen: Generation, http: Request, release: Callable[[], None]) -> Response:
    """The first chunk is awaited before the status line, so a request the backend refuses gets its status."""
    chunks = guarded(backend.stream(gen), http.is_disconnected)
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise
    return StreamingResponse(framed(first, chunks, release), media_type="text/event-stream")
