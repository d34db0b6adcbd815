"""The orchestrator's HTTP client to inference and teacher servers: httpx's API over aiohttp's connections.

Every rollout is an HTTP request. With its own connection pool (httpcore over anyio) httpx spent 1.3-1.7 ms of
client CPU per request on this 2-core machine at 16 concurrent group requests, over this transport 0.6-0.7 ms
(docs/benchmarks.md, "Fourth pass"). Those milliseconds come off the cores that generation and training
share. The callers keep httpx's interface (`AsyncClient`, `Response`, its exceptions: `wait_healthy` catches
`httpx.TransportError`); only the transport underneath changes.

Data flow: `httpx.AsyncClient(**settings(base_url, timeout_s))` -> a client whose transport is
`AiohttpTransport` -> per request, httpx builds the request (URL, headers, JSON body) -> `handle_async_request`
sends it on a pooled aiohttp connection with httpx's connect and read timeouts -> the whole body is read and handed
back as an `httpx.Response` (httpx decodes its content encoding). aiohttp's errors are raised as httpx's, so a
refused connection is `httpx.ConnectError` and a silent server `httpx.ReadTimeout`.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx

MAX_CONNECTIONS = 100  # as httpx's default pool; the callers' semaphores bound the requests in flight well below


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport on one aiohttp session, opened on first use (it must be made inside the event loop)."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS):
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            # httpx decodes the body per Content-Encoding; aiohttp must hand it over as sent
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=limits.get("connect"), sock_read=limits.get("read"))
        body = await request.aread()
        try:
            async with self._open().request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=body or None,
                allow_redirects=False,
                timeout=timeout,
            ) as r:
                content = await r.read()
                return httpx.Response(r.status, headers=r.raw_headers, content=content)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc, request) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _as_httpx(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """aiohttp's error as the httpx error a caller of httpx expects."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutError subclasses too
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.NetworkError(message, request=request)


def settings(base_url: str, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of an `httpx.AsyncClient` (or a subclass) for `base_url` on the aiohttp transport."""
    return {"base_url": base_url, "timeout": httpx.Timeout(timeout_s), "transport": AiohttpTransport()}
