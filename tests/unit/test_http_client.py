"""The orchestrator's httpx client on the aiohttp transport (engines/orchestrator/http_client.py), against a
real aiohttp server on loopback: bodies, headers and encodings arrive as httpx would deliver them, and aiohttp's
failures surface as the httpx errors the callers catch."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import httpx
import pytest
from aiohttp import web

from engines.orchestrator import http_client


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    payload = {
        "method": request.method,
        "body": json.loads(body) if body else None,
        "session": request.headers.get("X-Session-ID"),
    }
    return web.json_response(payload, status=201, headers={"X-Served": "yes"})


async def _gzipped(_: web.Request) -> web.Response:
    return web.Response(body=gzip.compress(b'{"ok": true}'), headers={"Content-Encoding": "gzip"})


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(2)
    return web.Response(text="late")


async def _serve(fn):
    app = web.Application()
    app.router.add_route("*", "/echo", _echo)
    app.router.add_get("/gzip", _gzipped)
    app.router.add_get("/slow", _slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await asyncio.wait_for(fn(f"http://127.0.0.1:{port}"), 30)
    finally:
        await runner.cleanup()


def test_round_trip_matches_httpx():
    async def check(url):
        async with httpx.AsyncClient(**http_client.settings(url, 10.0)) as c:
            r = await c.post("/echo", json={"prompt": [1, 2, 3], "n": 8}, headers={"X-Session-ID": "g-7"})
            g = await c.get("/echo", params={"q": "1"})
            z = await c.get("/gzip")
        return r, g, z

    r, g, z = asyncio.run(_serve(check))
    assert r.status_code == 201 and r.headers["x-served"] == "yes"
    assert r.json() == {"method": "POST", "body": {"prompt": [1, 2, 3], "n": 8}, "session": "g-7"}
    assert str(r.request.url).endswith("/echo")  # the client attaches its request, as with httpx's own transport
    assert g.json()["method"] == "GET" and g.json()["body"] is None
    assert z.json() == {"ok": True}  # httpx decoded the gzip body the transport passed through untouched


def test_many_concurrent_requests_reuse_a_bounded_pool():
    async def check(url):
        transport = http_client.AiohttpTransport(max_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=10.0, transport=transport) as c:
            out = await asyncio.gather(*(c.post("/echo", json={"i": i}) for i in range(40)))
            connector = transport._open().connector
            assert connector is not None and connector.limit == 4
        return [r.json()["body"]["i"] for r in out]

    assert asyncio.run(_serve(check)) == list(range(40))


def test_refused_connection_is_httpx_connect_error():
    with socket.socket() as s:  # a port nothing listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def call():
        async with httpx.AsyncClient(**http_client.settings(f"http://127.0.0.1:{port}", 5.0)) as c:
            await c.get("/health")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(call())


def test_silent_server_is_httpx_read_timeout():
    async def check(url):
        async with httpx.AsyncClient(**http_client.settings(url, 0.3)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.get("/slow")

    asyncio.run(_serve(check))
