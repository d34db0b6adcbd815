"""Hostile requests against the inference server, for tests and tests/bench/hostile_flood.py.

`HOSTILE` lists what issue 24's review sent: overflowing and oversized sampling fields, many and long stop
strings, bodies over the limit (declared and chunked), oversized prompts and message lists, malformed JSON,
admin routes with a missing, wrong or non-ASCII token, and heavy but valid requests at high concurrency.
`flood` sends them from several threads to one server on loopback until told to stop (and never more than
`max_requests`), counting per kind what came back: a status code, or the exception's name.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx

MAX_REQUESTS = 100_000
GONE_AFTER = 3


def _chunks(total: int, size: int = 1 << 16) -> Iterator[bytes]:
    """A JSON body sent chunked (no content-length), `total` bytes long."""
    yield b'{"prompt": "'
    for _ in range(total // size):
        yield b"a" * size
    yield b'", "max_tokens": 4}'


HOSTILE: list[tuple[str, str, dict[str, Any]]] = [
    ("huge top_k", "/v1/completions", {"json": {"prompt": "abc", "top_k": 2**63 - 1, "max_tokens": 8}}),
    ("huge n", "/v1/completions", {"json": {"prompt": "abc", "n": 10**6, "max_tokens": 8}}),
    (
        "many long stops",
        "/v1/completions",
        {"json": {"prompt": "abc", "n": 64, "max_tokens": 12, "stop": ["x" * 64 + str(i) for i in range(200)]}},
    ),
    ("bad token ids", "/v1/completions", {"json": {"prompt": [-1, 10**12, 3], "max_tokens": 4}}),
    ("long text prompt", "/v1/completions", {"json": {"prompt": "ab" * 2_000_000, "max_tokens": 4}}),
    ("body over the limit", "/v1/completions", {"content": b'{"prompt": "' + b"a" * (9 << 20) + b'"}'}),
    ("chunked body over the limit", "/v1/completions", {"content": "chunked"}),
    (
        "malformed json",
        "/v1/completions",
        {"content": b'{"prompt": [1, 2,', "headers": {"content-type": "application/json"}},
    ),
    ("many bad elements", "/v1/completions", {"json": {"prompt": ["x"] * 20_000, "max_tokens": 4}}),
    (
        "many messages",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "hi"}] * 50_000, "max_tokens": 4}},
    ),
    ("many logprobs", "/v1/completions", {"json": {"prompt": "abc", "logprobs": 10**9, "max_tokens": 4}}),
    ("heavy valid", "/v1/completions", {"json": {"prompt": "abcdef", "n": 64, "max_tokens": 32, "temperature": 1.0}}),
    ("admin without token", "/update_weights", {"json": {"version": 0}}),
    ("admin wrong token", "/update_weights", {"json": {"version": 0}, "headers": {"authorization": "Bearer nope"}}),
    (
        "admin non-ascii token",
        "/update_weights",
        {"json": {"version": 0}, "headers": {"authorization": "Bearer \u00e9\u00e9".encode()}},
    ),
    ("shutdown without token", "/shutdown", {}),
]


def send(client: httpx.Client, path: str, kwargs: dict[str, Any]) -> str:
    """One hostile request; its status code, or the name of what went wrong on the client's side."""
    kwargs = dict(kwargs)
    if kwargs.get("content") == "chunked":
        kwargs["content"] = _chunks(9 << 20)
    try:
        return str(client.post(path, **kwargs).status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


def wait_healthy(url: str, stop: threading.Event, timeout_s: float = 300) -> bool:
    """Whether the server at `url` answered /health before `stop` or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.2)
    return False


def flood(url: str, stop: threading.Event, workers: int, max_requests: int = MAX_REQUESTS) -> Counter:
    """`workers` threads cycling through HOSTILE against `url` (loopback) until `stop` or `max_requests`,
    from the moment the server is up."""
    assert url.startswith(("http://127.", "http://localhost")), f"hostile traffic stays on loopback, not {url}"
    if not wait_healthy(url, stop):
        return Counter()
    answers: Counter = Counter()
    budget = itertools.count()
    lock = threading.Lock()

    def worker(offset: int) -> None:
        refused = 0  # connections refused in a row: the server has gone (its run ended, or it died)
        with httpx.Client(base_url=url, timeout=60) as client:
            for name, path, kwargs in itertools.islice(itertools.cycle(HOSTILE), offset, None):
                if stop.is_set() or next(budget) >= max_requests or refused >= GONE_AFTER:
                    return
                got = send(client, path, kwargs)
                refused = refused + 1 if got == "ConnectError" else 0
                with lock:
                    answers[(name, got)] += 1

    run_all([lambda i=i: worker(i) for i in range(workers)])
    return answers


def run_all(fns: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
