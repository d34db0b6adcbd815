"""A backend from outside rollflow (tests/plugins/pkg/echobackend, registered by a dist-info entry point)
served by the real `python -m engines.inference` process through the one front end, with the real `openai`
client: completions and chat, streamed and not, OpenAI error bodies (the front end's and the backend's),
the request-body bound, admin auth on the weight update, a client leaving mid-request, and /shutdown.

Every test stands alone: the ones that change the served version start from whatever it is, and the one that
shuts the server down runs its own process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from config.model import ModelConfig
from config.process import ComponentPaths, InferenceProcessConfig
from config.storage import StorageConfig
from engines.protocol import ADMIN_TOKEN_ENV
from tests.unit.test_inference_plugins import PKG, ROOT, write_site

pytestmark = pytest.mark.slow
TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_LEN = 4096
DELAY_S = 0.005  # per token: a 2000-token request takes 10 s, long enough to leave half-way


def start(tmp: Path, site: Path) -> tuple[subprocess.Popen, str]:
    """The inference process for backend `echo` (the config is written as JSON: `echo` is registered only in
    the child's path), once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = InferenceProcessConfig(
        run=ComponentPaths(output_dir=str(tmp), run_id="t", storage=StorageConfig()),
        model=ModelConfig(max_seq_len=MAX_LEN),
        inference={"port": port},
        seed=0,
    ).model_dump(mode="json")
    cfg["inference"]["backend"] = "echo"
    (tmp / "inference.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PKG), str(ROOT)])}
    env |= {ADMIN_TOKEN_ENV: TOKEN, "ECHO_DELAY_S": str(DELAY_S)}
    argv = [sys.executable, "-m", "engines.inference", "--config", str(tmp / "inference.json")]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the inference process exited during start-up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the echo backend did not become healthy")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return write_site(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def served(tmp_path_factory, site):
    proc, url = start(tmp_path_factory.mktemp("run"), site)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def oai(served):
    import openai

    with openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _version(url: str) -> int:
    return httpx.get(url + "/health").json()["policy_version"]


def test_completions_and_chat_through_the_openai_client(oai):
    (card,) = oai.models.list().data
    assert card.id == "rollflow/t" and card.max_model_len == MAX_LEN
    r = oai.completions.create(
        model=card.id, prompt=[104, 105], n=2, max_tokens=5, logprobs=0, extra_body={"return_token_ids": True}
    )
    assert [c.text for c in r.choices] == ["hihih", "hihih"] and r.usage.completion_tokens == 10
    assert r.choices[0].token_ids == [104, 105, 104, 105, 104] and r.choices[0].prompt_token_ids == [104, 105]
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([-0.6931471805599453] * 5)
    chat = oai.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "ab"}], max_tokens=4, logprobs=True
    )
    assert chat.choices[0].message.content == "user" and len(chat.choices[0].logprobs.content) == 4


def test_streamed_answers_equal_the_unstreamed_ones(oai):
    kw = {"model": "rollflow/t", "prompt": "xyz", "max_tokens": 7}
    whole = oai.completions.create(**kw).choices[0].text
    chunks = list(oai.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole == "xyzxyzx"
    assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "ok"}]
    stream = oai.chat.completions.create(
        model="rollflow/t", messages=msgs, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    texts, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        texts += [c.delta.content or "" for c in chunk.choices]
    assert "".join(texts) == "user: " and usage.completion_tokens == 6


def test_errors_have_the_openai_shape(oai, served):
    import openai

    with pytest.raises(openai.BadRequestError, match="repetition_penalty") as front:
        oai.completions.create(model="rollflow/t", prompt="x", max_tokens=2, extra_body={"repetition_penalty": 1.1})
    assert front.value.body["type"] == "invalid_request_error" and front.value.body["param"] == "repetition_penalty"
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len 4096") as backend:
        oai.completions.create(model="rollflow/t", prompt="x", max_tokens=MAX_LEN)  # the backend's own refusal
    assert backend.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len"):  # also before a stream starts
        list(oai.completions.create(model="rollflow/t", prompt="x", max_tokens=MAX_LEN, stream=True))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    huge = httpx.post(served + "/v1/completions", json={"prompt": "x" * (9 * 2**20)}, timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["message"].startswith("request body over")
    paths = httpx.get(served + "/openapi.json").json()["paths"]
    assert {"400", "404", "413", "503"} <= set(paths["/v1/chat/completions"]["post"]["responses"])


def test_weight_updates_need_the_admin_token_and_change_the_reported_version(served):
    now = _version(served)
    r = httpx.post(served + "/update_weights", json={"version": now + 3})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert _version(served) == now
    r = httpx.post(served + "/update_weights", json={"version": now + 3}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["policy_version"] == now + 3
    c = httpx.post(served + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).json()["choices"][0]
    assert c["policy_version"] == c["policy_version_end"] == now + 3
    older = httpx.post(served + "/update_weights", json={"version": now + 1}, headers=ADMIN)
    assert older.status_code == 409 and older.json()["error"]["type"] == "conflict_error"
    path = httpx.post(served + "/update_weights", json={"path": "/x"}, headers=ADMIN)
    assert path.status_code == 400 and path.json()["error"]["param"] == "path"


def test_a_client_that_goes_away_stops_its_request(served):
    aborted = httpx.get(served + "/health").json()["stats"]["aborted"]
    body = {"prompt": "ab", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", served + "/v1/completions", json=body, timeout=30) as r:
        assert next(r.iter_lines()).startswith("data: {")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    deadline = time.monotonic() + 5  # well under the 10 s either request would run
    while httpx.get(served + "/health").json()["stats"]["aborted"] < aborted + 2:
        assert time.monotonic() < deadline, "the backend did not see both clients leave"
        time.sleep(0.1)


def test_shutdown_needs_the_token_and_ends_the_process(tmp_path, site):
    proc, url = start(tmp_path, site)
    try:
        assert httpx.post(url + "/shutdown", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert proc.poll() is None
        assert httpx.post(url + "/shutdown", headers=ADMIN).json() == {"status": "shutting down"}
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
