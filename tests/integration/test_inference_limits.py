"""Hostile requests against the real inference server (`python -m engines.inference`, embedded engine, a tiny MoE
model) on 127.0.0.1: each is refused with its own status in OpenAI's error shape, and none stops the requests
running beside it. Small admission limits (3 requests, 3000 tokens of work) make the 429s reachable.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from config.model import ModelConfig
from engines import protocol as api
from tests.inference_fixture import publish, serving

MOE = ModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_seq_len=1024,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)  # fmt: skip
LIMITS = {"max_queued_requests": 3, "max_queued_tokens": 3000, "retry_after_s": 2, "enable_return_routed_experts": True}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[httpx.Client]:
    root = str(tmp_path_factory.mktemp("run"))
    publish(root, MOE, 0, seed=1)
    with serving(root, MOE, LIMITS) as c:
        yield c


def _healthy(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) <= 3


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()))
    thread.start()
    return thread, out


def test_a_huge_top_k_fails_alone_while_another_request_runs(client):
    body = {"prompt": [1, 5], "n": 2, "max_tokens": 300, "ignore_eos": True, "return_token_ids": True}
    running, out = _in_thread(lambda: client.post("/v1/completions", json=body))
    time.sleep(0.3)  # it is in the batch
    bad = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 4, "top_k": 2**63})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
    running.join(timeout=60)
    r = out["result"]
    assert r.status_code == 200, r.text
    assert [len(c["token_ids"]) for c in r.json()["choices"]] == [300, 300]
    _healthy(client)


def test_stop_strings_are_bounded_in_count_and_length(client):
    base = {"prompt": [1, 5], "max_tokens": 4}
    for stop in (["a", "b", "c", "d", "e"], "x" * (api.MAX_STOP_CHARS + 1), [""], ""):
        r = client.post("/v1/completions", json={**base, "stop": stop})
        assert r.status_code == 400 and "stop" in r.json()["error"]["message"], (stop, r.text)
    most = [c * api.MAX_STOP_CHARS for c in "wxyz"]
    assert client.post("/v1/completions", json={**base, "stop": most}).status_code == 200


def test_a_body_over_the_limit_is_a_413_even_chunked(client):
    def chunks() -> Iterator[bytes]:  # no content-length: Transfer-Encoding chunked
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * 2**20
        yield b'", "max_tokens": 2}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body over")
    _healthy(client)


def test_a_body_with_many_errors_gets_a_short_answer(client):
    r = client.post("/v1/completions", json={"prompt": ["x"] * 20_000, "max_tokens": 2})
    assert r.status_code == 400 and len(r.content) < 5000, len(r.content)
    assert "more errors" in r.json()["error"]["message"]


def test_a_text_prompt_too_long_to_fit_is_refused_before_tokenising(client):
    r = client.post("/v1/completions", json={"prompt": "x" * (32 * MOE.max_seq_len + 1), "max_tokens": 2})
    assert r.status_code == 400 and "characters cannot fit max_model_len" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "x" * 10}] * (api.MAX_MESSAGES + 1), "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 400


def test_admission_answers_429_with_retry_after_when_full(client):
    hold = {"prompt": [1, 5], "n": 1, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with ExitStack() as held:
        for max_tokens in (1000, 1000, 990):  # 1002 + 1002 + 992 of the 3000 tokens, 3 of the 3 requests
            r = held.enter_context(client.stream("POST", "/v1/completions", json={**hold, "max_tokens": max_tokens}))
            assert r.status_code == 200
        full = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
        assert full.status_code == 429 and full.headers["retry-after"] == "2", full.text
        assert full.json()["error"]["type"] == "rate_limit_error" and "max_queued_requests" in full.text
    _released(client)
    over_budget = {"prompt": [1, 5], "n": 3, "max_tokens": 1000}
    assert client.post("/v1/completions", json=over_budget).status_code == 400  # 3006 tokens: never fits
    with ExitStack() as held:
        for _ in range(2):
            held.enter_context(client.stream("POST", "/v1/completions", json=hold))
        r = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 1000})
        assert r.status_code == 429 and "max_queued_tokens" in r.text and r.headers["retry-after"] == "2"
    _released(client)
    _healthy(client)


def _released(client: httpx.Client) -> None:
    """Wait (bounded) until the server has let go of the requests whose clients closed."""
    deadline = time.monotonic() + 10
    while (stats := client.get("/health").json()["stats"])["held_requests"] or stats["held_tokens"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_routed_experts_only_when_asked(client):
    body = {"prompt": [1, 5, 7], "max_tokens": 3, "n": 2, "return_token_ids": True}
    plain = client.post("/v1/completions", json=body).json()
    assert [c["routed_experts"] for c in plain["choices"]] == [None, None]
    asked = client.post("/v1/completions", json={**body, "return_routed_experts": True})
    assert asked.status_code == 200, asked.text
    for c in asked.json()["choices"]:
        seq = 3 + len(c["token_ids"]) - 1
        assert len(c["routed_experts"]) == seq and len(c["routed_experts"][0]) == MOE.num_layers


def test_a_non_ascii_authorization_header_is_a_401(client):
    for value in ("Bearer é".encode("latin-1"), "Bearer ☃".encode(), b"\xff\xfe"):
        r = client.post("/update_weights", json={"version": 0}, headers={"Authorization": value})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    _healthy(client)  # the same connection still answers


def test_the_orchestrator_checks_the_server_holds_the_token_before_sending_it(client):
    """A process that took the port first (it answers /health like a server) gets no token and no requests."""
    import asyncio
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from engines.orchestrator.loop import wait_healthy
    from tests.inference_fixture import TOKEN

    seen: list[str] = []

    class Squatter(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(f"{self.path} {self.headers.get('authorization')}")
            body = json.dumps({"status": "ok", "policy_version": 0, "stats": {}, "proof": "0" * 64}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    squatter = ThreadingHTTPServer(("127.0.0.1", 0), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()

    async def check(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            await wait_healthy(c, 10, TOKEN)

    try:
        with pytest.raises(RuntimeError, match="does not hold this attempt's admin token"):
            asyncio.run(check(f"http://127.0.0.1:{squatter.server_address[1]}"))
    finally:
        squatter.shutdown()
        squatter.server_close()
    assert [s.split(" ")[0].split("?")[0] for s in seen] == ["/health", "/identity"]
    assert not any(TOKEN in s for s in seen)
    assert all(s.endswith(" None") for s in seen)  # no Authorization header reached it
    asyncio.run(check(str(client.base_url)))  # the real server proves it holds the token
    assert client.get("/identity", params={"nonce": "x"}).status_code == 400


# --- fuzzing the OpenAPI document's request bodies -------------------------------------------------------------

HOSTILE: list = [
    None, True, 0, 1, -1, 2**31, 2**63, -(2**63), 2**64, 10**30, 1e308, -1e308, 5e-324, 0.5, "", "x", "é☃\x00",
    "x" * 5000, [], [None], [2**63], ["x"] * 50, {}, {"a": 1}, [[[[[]]]]],
]  # fmt: skip
RAW = [
    b"", b"{", b"[]", b"null", b'"x"', b"1", b"[" * 5000 + b"]" * 5000, b'{"prompt": [1], "temperature": NaN}',
    b'{"prompt": [1], "top_p": Infinity}', b'{"prompt": [1], "max_tokens": 1e400}',
    b'{"prompt": [' + b"9" * 5000 + b"]}", b'{"prompt": "\\ud800"}', b"\xff\xfe\x00",
]  # fmt: skip


def _fields(schema: dict, name: str) -> list[str]:
    return list(schema["components"]["schemas"][name]["properties"])


def _bodies(schema: dict, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Valid small bodies of each generation route with 1-3 fields set to hostile values, unknown fields, raw bytes."""
    routes = {
        "/v1/completions": ("CompletionRequest", {"prompt": [1, 5], "max_tokens": 4}),
        "/v1/chat/completions": ("ChatRequest", {"messages": [{"role": "user", "content": "1+1"}], "max_tokens": 4}),
        "/update_weights": ("UpdateWeightsRequest", {"version": 0}),
    }
    while True:
        path = rng.choice(list(routes))
        name, base = routes[path]
        if rng.random() < 0.1:
            yield path, rng.choice(RAW)
            continue
        body = dict(base)
        for field in rng.sample(_fields(schema, name) + ["unknown"], rng.randint(1, 3)):
            value = rng.choice(HOSTILE)
            body[field] = value if rng.random() < 0.9 else [{"role": "user", "content": value}]
        yield path, json.dumps(body).encode()


def fuzz(client: httpx.Client, seconds: float, examples: int, seed: int) -> int:
    """Send hostile bodies for `seconds` (at most `examples`) while normal requests keep running beside them; no
    answer is a 5xx, every error has OpenAI's shape, every normal request completes. Returns how many were sent."""
    schema = client.get("/openapi.json").json()
    rng, stop, normal = random.Random(seed), threading.Event(), []

    def beside() -> None:
        with httpx.Client(base_url=client.base_url, timeout=60) as c:
            while not stop.is_set():
                normal.append(c.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 8}).status_code)

    thread = threading.Thread(target=beside)
    thread.start()
    sent, deadline = 0, time.monotonic() + seconds
    try:
        for path, raw in _bodies(schema, rng):
            if sent >= examples or time.monotonic() > deadline:
                break
            headers = {"content-type": "application/json", "authorization": rng.choice(["", "Bearer x", "Bearer"])}
            r = client.post(path, content=raw, headers=headers)
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:500])
            if r.status_code >= 400:
                assert set(r.json()) == {"error", "detail"} and len(r.content) < 5000, (raw[:300], r.text[:500])
            sent += 1
    finally:
        stop.set()
        thread.join(timeout=60)
    assert normal and set(normal) == {200}, normal
    _healthy(client)
    return sent


def test_fuzzed_request_bodies_never_get_a_5xx_nor_stop_the_batch(client):
    sent = fuzz(client, seconds=4, examples=2000, seed=0)
    print(f"fuzz: {sent} hostile requests")


@pytest.mark.long
def test_fuzzed_request_bodies_long(client):
    for seed in range(1, 4):
        fuzz(client, seconds=60, examples=20_000, seed=seed)
