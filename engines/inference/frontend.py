"""The inference HTTP API, written once over any `Backend` (engines/inference/backend.py).

    GET  /health, /v1/models, /openapi.json
    GET  /identity?nonce=HEX                      proof that the server holds the admin token (no token sent)
    POST /v1/completions, /v1/chat/completions    OpenAI-compatible; `stream=true` answers server-sent events
    POST /update_weights, /shutdown               admin: `Authorization: Bearer <token>`

A shared deployment's server (a backend with `tenant_auth`, docs/multitenant.md) serves tenants: a generation's
`model` names the tenant and its `Authorization: Bearer` carries that tenant's token (404 / 401 otherwise), and
/update_weights takes a `tenant` and its token in place of the admin token (/shutdown stays the admin's).

A request body is bounded in size (413, chunked bodies included), validated against engines/protocol.py (an
unknown field, an unsupported value or one over a limit is a 400 naming it; the message lists the first few
errors and a count), checked against the model's length (a text prompt before it is tokenised), admitted (at
most `max_queued_requests` requests and `max_queued_tokens` tokens of work held at once, else a 429 with
Retry-After), and turned into a `Generation` (the configured session header's value, the
request id, the client's other x- headers, and the images: `images` (base64) decoded within the bounds of
engines/models/vision.py and checked against the prompt's image token runs and the model's `VisionSpec`; a
text-only model refuses them); the backend answers it. Every error, the backend's included, has
OpenAI's shape (`{"error": {message, type, param, code}, "detail"}`), and OpenAPI lists each route's errors.
A client that goes away (checked every DISCONNECT_POLL_S while it waits, since a closed connection is not
always noticed on write) cancels its generation, which stops the backend's work on it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from engines import protocol as api
from engines.heartbeat import Heartbeat, heartbeat
from engines.inference.backend import Backend, BackendError, Generation
from engines.models import vision
from engines.models.vision import VisionSpec

DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 8 * 2**20  # far above any prompt of max_model_len tokens; a larger body is a 413
MAX_IN_FLIGHT = 1024  # generation requests held at once (inference.max_queued_requests); one more is a 429
# A text prompt (or a chat's contents) longer than this many characters per max_model_len token cannot fit
# any tokenizer's max_model_len (no vocabulary has longer tokens in practice): refused before it is tokenised
MAX_CHARS_PER_TOKEN = 32
MAX_ERRORS_SHOWN = 3  # validation errors a 400 lists (then how many more): a bad body never makes a huge answer
MAX_MESSAGE_CHARS = 2000  # an error message is cut here (a message may quote a client's value)
REQUEST_ID_HEADER = "x-request-id"

ERRORS = {
    400: "invalid request: a malformed body, an unknown or unsupported field, a value over a limit, or a request "
    "that cannot run (empty prompt, token ids outside the vocabulary, prompt + max_tokens over max_model_len, "
    "n over the batch, more tokens of work than the server's whole budget, images to a text-only model, an image that "
    "does not decode or breaks a bound, image token runs that do not match the images)",
    401: "admin route without the right bearer token (a shared server: the tenant's token)",
    403: "a shared server's tenant that was refused (its adapter's base is not the backbone, or no slot is free)",
    404: "unknown model name (a shared server: no such tenant), or no committed publication at that version or path",
    410: "a shared server's tenant that left (or restarted) while its request waited or ran",
    409: "a publication older than the served version",
    413: f"a request body over {MAX_BODY_BYTES} bytes",
    422: "a corrupted publication or one that does not fit the model (the file or the tensors are named)",
    429: "the server holds its most requests or tokens of work (inference.max_queued_requests / max_queued_tokens): "
    "retry after the Retry-After header's seconds",
    503: "the backend cannot serve now (an upstream server is down)",
}
KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
         410: "not_found_error", 429: "rate_limit_error", 500: "internal_error",
         503: "service_unavailable_error"}  # fmt: skip
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    admin_token: str
    session_header: str = api.SESSION_HEADER  # inference.router.session_header: whose value names the session
    max_body_bytes: int = MAX_BODY_BYTES
    max_in_flight: int = MAX_IN_FLIGHT  # inference.max_queued_requests
    max_tokens: int | None = None  # inference.max_queued_tokens (resolved); None: no token budget
    retry_after_s: int = 1


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


def error_body(code: int, message: str, param: str | None = None) -> dict:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
    error = api.ErrorBody(message=message, type=KINDS.get(code, "invalid_request_error"), param=param, code=code)
    return api.ErrorResponse(error=error, detail=message).model_dump()


def _errors(*codes: int) -> dict:
    """The OpenAPI `responses` entry of a route: each error it returns, in the OpenAI error shape."""
    return {c: {"model": api.ErrorResponse, "description": ERRORS[c]} for c in codes}


def admin_auth(token: str) -> Callable[..., None]:
    """The dependency of every admin route: `Authorization: Bearer <token>` or 401."""

    expected = f"Bearer {token}".encode()

    def check(authorization: str | None = Header(default=None)) -> None:
        # as bytes: compare_digest refuses a str with non-ASCII characters (a header may carry any latin-1 byte)
        given = None if authorization is None else authorization.encode("utf-8", "surrogateescape")
        if given is None or not secrets.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="admin route: missing or wrong bearer token")

    return check


class HeldWork:
    """Holds every POST (generation, weight update) in the process's heartbeat while it runs; each response
    chunk sent is progress (engines/heartbeat.py: a server holding work that stops moving is stuck)."""

    def __init__(self, app, beat: Heartbeat):
        self.app, self.beat = app, beat

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)

        async def sending(message):
            if message["type"] == "http.response.body":
                self.beat.advance()
            await send(message)

        with self.beat.hold():
            await self.app(scope, receive, sending)


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

    def reply(code: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
        return JSONResponse(error_body(code, message, param), status_code=code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return reply(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(BackendError)
    async def backend_error(request, exc):
        return reply(exc.status, exc.message, exc.param)

    @app.exception_handler(Exception)
    async def internal(request, exc):  # still logged: Starlette re-raises it after answering
        return reply(500, f"{type(exc).__name__}: {exc}")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        errors = exc.errors()
        where = [".".join(str(x) for x in e.get("loc", ())[1:]) for e in errors[:MAX_ERRORS_SHOWN]]
        message = "; ".join(f"{w or 'body'}: {e['msg']}" for w, e in zip(where, errors, strict=False))
        if len(errors) > MAX_ERRORS_SHOWN:
            message += f"; and {len(errors) - MAX_ERRORS_SHOWN} more errors"
        return reply(400, message, (where[0] or None) if where else None)

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


async def framed(
    first: dict | None, rest: AsyncIterator[dict], release: Callable[[], None], routes: bool = False
) -> AsyncIterator[str]:
    """The event stream: each chunk as `data: {json}` (`routed_experts` only with `routes`), then `data: [DONE]`;
    an error after the status line was sent goes in the stream as an error event."""
    try:
        if first is not None:
            yield sse(first if routes else without_routes(first))
        async for chunk in rest:
            yield sse(chunk if routes else without_routes(chunk))
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


def answer_body(body: Any, with_routes: bool) -> Response:
    """A generation's answer, without `routed_experts` unless the client asked for them. A typed answer is
    serialised by pydantic in one call: a group's answer holds a few thousand tokens and logprobs, which
    `model_dump` and json.dumps would walk as Python objects."""
    if not isinstance(body, BaseModel):
        return JSONResponse(body if with_routes else without_routes(body))
    choices = getattr(body, "choices", None) or []
    if not with_routes and any(getattr(c, "routed_experts", None) is not None for c in choices):
        body = body.model_copy(update={"choices": [c.model_copy(update={"routed_experts": None}) for c in choices]})
    return Response(body.model_dump_json(), media_type="application/json")


def build_app(backend: Backend, settings: Settings) -> FastAPI:
    """The app serving `backend`; `app.state.server`, when set, is the uvicorn server /shutdown stops."""
    app = FastAPI(title=f"rollflow inference ({type(backend).__name__})")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(HeldWork, beat=heartbeat())
    admin = Depends(admin_auth(settings.admin_token))
    admission = Admission(settings)
    generate = _generation_route(backend, settings, admission)
    started = int(time.time())

    @app.get("/health", responses=_errors(503))
    async def health() -> api.HealthResponse:
        """The backend's health, its stats with what admission holds (`held_requests`, `held_tokens`)."""
        h = await backend.health()
        return h.model_copy(
            update={"stats": {**h.stats, "held_requests": admission.requests, "held_tokens": admission.tokens}}
        )

    @app.get("/identity")
    def identity(nonce: Annotated[str, Query(pattern="^[0-9a-f]{32,128}$")]) -> api.IdentityResponse:
        """Proof that this server holds the attempt's admin token (engines/protocol.py identity_proof)."""
        return api.IdentityResponse(proof=api.identity_proof(settings.admin_token, nonce))

    @app.get("/v1/models")
    def models() -> api.ModelList:
        name = backend.model_name
        return api.ModelList(
            data=[api.ModelCard(id=name, created=started, root=name, max_model_len=backend.max_model_len)]
        )

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=_errors(400, 404, 413, 429, 503))
    async def completions(req: api.CompletionRequest, http: Request) -> Response:
        """Token ids or text in; with `stream=true` the answer is `text/event-stream` chunks instead."""
        return await generate(req, http)

    @app.post("/v1/chat/completions", response_model=api.ChatResponse, responses=_errors(400, 404, 413, 429, 503))
    async def chat(req: api.ChatRequest, http: Request) -> Response:
        """Messages in (the chat template); with `stream=true`, `text/event-stream` chunks."""
        return await generate(req, http)

    _update_route(app, backend, admin)

    @app.post("/shutdown", dependencies=[admin], responses=_errors(401))
    async def shutdown() -> dict:
        if server := getattr(app.state, "server", None):
            server.should_exit = True
        return {"status": "shutting down"}

    return app


def _update_route(app: FastAPI, backend: Backend, admin) -> None:
    """POST /update_weights: the admin token's, or on a shared server the named tenant's (its own token)."""
    gate = backend.tenant_auth
    if gate is None:

        @app.post("/update_weights", dependencies=[admin], responses=_errors(400, 401, 404, 409, 422, 503))
        async def update_weights(req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
            return await backend.update_weights(req)

        return

    @app.post("/update_weights", responses=_errors(400, 401, 403, 404, 409, 410, 422, 503))
    async def update_tenant(
        req: api.UpdateWeightsRequest, authorization: str | None = Header(default=None)
    ) -> api.UpdateWeightsResponse:
        """A tenant's adapter: `tenant` and `version`, with the tenant's bearer token."""
        if req.tenant is None or req.version is None:
            raise HTTPException(400, "a shared server updates one tenant's adapter: give `tenant` and `version`")
        gate.authorize(req.tenant, authorization)
        return await backend.update_weights(req)


class Admission:
    """What the server holds at once: at most `requests` generation requests and `tokens` tokens of work (each
    request's `cost`); one more is a 429 with Retry-After. A request over the whole budget is a 400 (it never fits)."""

    def __init__(self, settings: Settings):
        self.settings, self.requests, self.tokens = settings, 0, 0

    def enter(self, cost: int) -> None:
        s = self.settings
        if s.max_tokens is not None and cost > s.max_tokens:
            whole = f"the server's whole budget of {s.max_tokens} (inference.max_queued_tokens)"
            raise HTTPException(400, f"the request is {cost} tokens of work (n * (prompt + max_tokens)), over {whole}")
        full = None
        if self.requests >= s.max_in_flight:
            full = f"{self.requests} requests held (inference.max_queued_requests)"
        elif s.max_tokens is not None and self.tokens + cost > s.max_tokens:
            full = f"{self.tokens} of {s.max_tokens} tokens of work held (inference.max_queued_tokens)"
        if full:
            raise HTTPException(429, f"the server is full: {full}; retry later", {"Retry-After": str(s.retry_after_s)})
        self.requests, self.tokens = self.requests + 1, self.tokens + cost

    def leave(self, cost: int) -> None:
        self.requests, self.tokens = self.requests - 1, self.tokens - cost


def prompt_texts(body: api.CompletionRequest | api.ChatRequest) -> list[str] | None:
    """The prompt's text (a chat's contents), or None for token ids."""
    if isinstance(body, api.ChatRequest):
        return [m.text() for m in body.messages]
    return [body.prompt] if isinstance(body.prompt, str) else None


def prompt_size(body: api.CompletionRequest | api.ChatRequest) -> int:
    """The prompt's length: characters of text (before tokenising), or token ids."""
    texts = prompt_texts(body)
    if texts is None:
        assert isinstance(body, api.CompletionRequest)
        return len(body.prompt)
    return sum(map(len, texts))


def cost(body: api.CompletionRequest | api.ChatRequest, max_model_len: int) -> int:
    """A request's tokens of work: n * (prompt + max_tokens), at most n * max_model_len (text counts a token per
    character, a bound the max_model_len cap keeps from over-counting much)."""
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    size = prompt_size(body)
    return body.n * (max_model_len if limit is None else min(max_model_len, size + limit))


def check_length(body: api.CompletionRequest | api.ChatRequest, max_model_len: int) -> None:
    """Refuse a prompt that cannot fit max_model_len, or text no tokenizer takes, before it is tokenised."""
    size, texts = prompt_size(body), prompt_texts(body)
    most = max_model_len * MAX_CHARS_PER_TOKEN if texts is not None else max_model_len
    if size > most:
        unit = "characters" if texts is not None else "token ids"
        raise HTTPException(400, f"prompt of {size} {unit} cannot fit max_model_len {max_model_len} (at most {most})")
    try:
        for text in texts or []:
            text.encode()
    except UnicodeEncodeError as exc:  # JSON's escapes can spell a lone surrogate, which is no character
        raise HTTPException(400, f"prompt text is not valid Unicode: {exc.reason} at {exc.start}") from None


def _generation_route(backend: Backend, settings: Settings, admission: Admission):
    """What both generation routes do: check the model name and the prompt's length, hold a place in the
    admission budget while the request runs, answer."""

    async def answer(body: api.CompletionRequest | api.ChatRequest, http: Request) -> Response:
        tenant = None
        if backend.tenant_auth is not None:  # a shared server: `model` names the tenant, its token proves it
            tenant = backend.tenant_auth.authorize(body.model, http.headers.get("authorization"))
        elif body.model is not None and body.model != backend.model_name:
            raise HTTPException(404, f"model {body.model!r} does not exist: this server serves {backend.model_name!r}")
        check_length(body, backend.max_model_len)
        work = cost(body, backend.max_model_len)
        admission.enter(work)
        release_here = True
        try:
            gen = generation(body, http.headers, settings.session_header)
            gen.tenant = tenant
            spec = backend.vision_spec  # decoding images is CPU work: off the event loop (a text model's check is not)
            gen.images = await asyncio.to_thread(request_images, body, spec) if spec else request_images(body, None)
            if body.stream:
                response = await _stream(backend, gen, http, lambda: admission.leave(work))
                release_here = False  # the stream holds its place until it ends
                return response
            answered = await until_gone(backend.generate(gen), http.is_disconnected)
            return answer_body(answered, bool(body.return_routed_experts))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        finally:
            if release_here:
                admission.leave(work)

    return answer


def request_images(body: api.CompletionRequest | api.ChatRequest, spec: VisionSpec | None) -> tuple[bytes, ...]:
    """The request's images (bytes, in prompt order: `images`, or a chat's image parts), each decoded within
    vision.py's bounds, and a token-id prompt's image token runs checked against them (also without images: a
    vision model's prompt may hold no image tokens then). A problem is a 400 naming it, for this request alone."""
    images = body.images() if isinstance(body, api.ChatRequest) else body.images or []
    if images and spec is None:
        raise BackendError(400, "this server's model is text-only: it takes no images", "images")
    ids = None if isinstance(body, api.ChatRequest) or isinstance(body.prompt, str) else body.prompt
    if spec is None or (ids is None and not images):
        return ()
    found, sizes = [], []
    try:
        for i, text in enumerate(images):
            try:
                data = base64.b64decode(text, validate=True)
            except ValueError:  # binascii.Error
                raise vision.ImageError(f"images[{i}]: not valid base64") from None
            img = vision.decode(data, f"images[{i}]")
            found.append(data)
            sizes.append((img.width, img.height))
        if ids is not None:  # a chat's ids are rendered by the backend, which checks them
            vision.check_prompt(ids, sizes, spec)
    except vision.ImageError as exc:
        raise BackendError(400, str(exc), "images") from None
    return tuple(found)


def without_routes(body: Any) -> Any:
    """A response (or stream chunk) without `routed_experts`, which a client gets only when it asks."""
    if isinstance(body, dict):
        for choice in body.get("choices") or []:
            if isinstance(choice, dict) and choice.get("routed_experts") is not None:
                choice["routed_experts"] = None
    return body


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
    routes = bool(gen.body.return_routed_experts)
    return StreamingResponse(framed(first, chunks, release, routes), media_type="text/event-stream")
