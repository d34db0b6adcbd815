"""The embedded backend behind the front end, as a real `python -m engines.inference` process over real HTTP
on 127.0.0.1, with the real `openai` client.

Every test stands alone, in any order: a test that changes the served policy publishes its own versions
(above whatever is served when it starts, in its own directory) and each logprob check compares with the
model of the version the response itself reports (`models[policy_version]`).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from config.model import ModelConfig
from engines.models.decoder import CausalLM, token_logprobs
from engines.models.tokenizer import CharTokenizer
from storage import weights
from storage.fs import get_fs
from tests.inference_fixture import ADMIN, publish, serving

# max_seq_len leaves room for requests long enough to be aborted half-way (test_a_client_that_goes_away_*)
MODEL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=1024)


def _publish(root: str, version: int, seed: int) -> CausalLM:
    return publish(root, MODEL, version, seed)


def _served(client: httpx.Client) -> int:
    return client.get("/health").json()["policy_version"]


def _assert_logprobs_match(model: CausalLM, prompt: list[int], choice: dict, temperature: float) -> None:
    """The server's per-token logprobs equal a full forward of the same weights over prompt + completion."""
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        expected = token_logprobs(model(ids)[:, :-1], ids[:, 1:], temperature)[0, len(prompt) - 1 :]
    assert torch.allclose(expected, torch.tensor(choice["logprobs"]["token_logprobs"]), atol=1e-4)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("run"))
    models = {0: _publish(root, 0, seed=1)}
    with serving(root, MODEL) as client:
        yield client, root, models


def test_completions_return_ids_and_logprobs_that_match_the_model(server):
    client, _, models = server
    tok = CharTokenizer()
    prompt = tok.encode("rev:abc=")
    body = {"prompt": prompt, "n": 3, "max_tokens": 6, "temperature": 0.8, "logprobs": 1, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert len(choices) == 3
    for c in choices:
        assert 1 <= len(c["token_ids"]) <= 6 and len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
        assert c["policy_version"] == c["policy_version_end"] == _served(client)
        _assert_logprobs_match(models[c["policy_version"]], prompt, c, 0.8)


def test_text_prompt_and_chat_completions(server):
    client, _, _ = server
    r = client.post("/v1/completions", json={"prompt": "sort:cba=", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] is None
    chat = {"messages": [{"role": "user", "content": "rev:abc"}], "max_tokens": 4, "logprobs": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == r.json()["usage"]["completion_tokens"]


def test_admin_routes_need_the_token(server):
    client, _, _ = server
    r = client.post("/update_weights", json={"version": 0})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = {"Authorization": "Bearer nope"}
    assert client.post("/update_weights", json={"version": 0}, headers=bad).status_code == 401
    assert client.post("/shutdown", headers=bad).status_code == 401


def test_update_weights_serves_the_new_policy(server, tmp_path):
    client, _, models = server
    version = _served(client) + 1
    model = _publish(str(tmp_path), version, seed=version + 1)
    r = client.post("/update_weights", json={"path": weights.version_dir(str(tmp_path), version)}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["policy_version"] == version and r.json()["source"] == "filesystem"
    models[version] = model
    assert _served(client) == version
    tok = CharTokenizer()
    prompt = tok.encode("rev:xy=")
    body = {"prompt": prompt, "max_tokens": 5, "logprobs": 1, "return_token_ids": True}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    assert c["policy_version"] == version
    _assert_logprobs_match(model, prompt, c, 1.0)


def test_update_to_a_missing_version_fails_without_changing_the_policy(server):
    client, _, _ = server
    before = _served(client)
    r = client.post("/update_weights", json={"version": before + 1000}, headers=ADMIN)
    assert r.status_code == 404 and "no committed weights" in r.json()["error"]["message"]
    assert _served(client) == before


def test_update_to_corrupt_weights_is_refused_with_the_file_named(server, tmp_path):
    client, _, _ = server
    before = _served(client)
    _publish(str(tmp_path), before + 1, seed=3)
    directory = weights.version_dir(str(tmp_path), before + 1)
    path = Path(directory) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    r = client.post("/update_weights", json={"path": directory}, headers=ADMIN)
    assert r.status_code == 422 and "model.safetensors" in r.json()["detail"]
    assert _served(client) == before


def test_bad_requests_are_refused_before_they_reach_a_batch(server):
    client, _, _ = server
    for body in (
        {"prompt": [], "max_tokens": 4},
        {"prompt": [1, 10_000], "max_tokens": 4},
        {"prompt": [1, 5], "max_tokens": MODEL.max_seq_len},
        {"prompt": [1, 5], "max_tokens": 4, "n": 100_000},
    ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    huge = client.post("/v1/completions", json={"prompt": "x" * (9 * 2**20), "max_tokens": 2})  # over 8 MiB
    assert huge.status_code == 413 and "request body over" in huge.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2}).status_code == 200


def test_weights_that_do_not_fit_are_refused(server, tmp_path):
    client, _, _ = server
    before = _served(client)
    other = CausalLM(MODEL.model_copy(update={"hidden_size": 32, "intermediate_size": 64}), CharTokenizer().vocab_size)
    fs, r = get_fs(str(tmp_path))
    directory = weights.publish(fs, r, before + 10, other.publishable_state_dict())
    resp = client.post("/update_weights", json={"path": directory}, headers=ADMIN)
    assert resp.status_code == 422 and "do not fit" in resp.json()["detail"]
    assert _served(client) == before


def test_an_older_version_is_not_served(server, tmp_path):
    """Two publications of its own: the newer one is served, then the older one is refused (409)."""
    client, _, models = server
    older, newer = _served(client) + 1, _served(client) + 2
    model = _publish(str(tmp_path / "b"), newer, seed=newer)
    r = client.post("/update_weights", json={"path": weights.version_dir(str(tmp_path / "b"), newer)}, headers=ADMIN)
    assert r.status_code == 200
    models[newer] = model
    _publish(str(tmp_path / "a"), older, seed=older)
    r = client.post("/update_weights", json={"path": weights.version_dir(str(tmp_path / "a"), older)}, headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
    assert _served(client) == newer
    r2 = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2, "return_token_ids": True})
    assert r2.json()["choices"][0]["policy_version"] == newer


# --- the real `openai` client against the same server ------------------------------------------------------


@pytest.fixture(scope="module")
def oai(server):
    import openai

    client, _, _ = server
    name = client.get("/v1/models").json()["data"][0]["id"]
    with openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c, name


CHAT = [{"role": "user", "content": "rev:abcd"}]


def test_openai_chat_with_n_logprobs_and_token_ids(oai, server):
    c, name = oai
    r = c.chat.completions.create(
        model=name, messages=CHAT, n=2, max_tokens=6, logprobs=True, top_logprobs=3, seed=11,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(r.choices) == 2 and r.usage.completion_tokens == sum(len(ch.token_ids) for ch in r.choices)
    prompt = r.prompt_token_ids  # vLLM's placement for chat: top level
    assert prompt == CharTokenizer().render_messages(CHAT)
    for ch in r.choices:
        assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
        assert [lp.token for lp in ch.logprobs.content] == [CharTokenizer().decode([t], False) for t in ch.token_ids]
        for lp in ch.logprobs.content:  # three alternatives, most likely first, none likelier than the first
            assert len(lp.top_logprobs) == 3 and lp.logprob <= lp.top_logprobs[0].logprob + 1e-6
            assert [a.logprob for a in lp.top_logprobs] == sorted((a.logprob for a in lp.top_logprobs), reverse=True)
    models = server[2]
    for ch in r.choices:  # the logprobs are those of the model of the version the choice reports
        fake = {"token_ids": ch.token_ids, "logprobs": {"token_logprobs": [lp.logprob for lp in ch.logprobs.content]}}
        _assert_logprobs_match(models[ch.policy_version], prompt, fake, 1.0)


def test_openai_completions_return_prompt_and_completion_ids(oai):
    c, name = oai
    tok = CharTokenizer()
    prompt = tok.encode("sort:dcba=")
    r = c.completions.create(
        model=name, prompt=prompt, n=3, max_tokens=5, logprobs=2, temperature=0.9, seed=5,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.prompt_token_ids == prompt and 1 <= len(ch.token_ids) <= 5
        assert len(ch.logprobs.token_logprobs) == len(ch.token_ids) == len(ch.logprobs.tokens)
        assert len(ch.logprobs.top_logprobs) == len(ch.token_ids)
        assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6 for top, lp in zip(
            ch.logprobs.top_logprobs, ch.logprobs.token_logprobs, strict=True))  # fmt: skip
    assert r.choices[0].token_ids != r.choices[1].token_ids or r.choices[1].token_ids != r.choices[2].token_ids


def _chat_stream(c, name, **kw) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str], object]:
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in c.chat.completions.create(model=name, messages=CHAT, stream=True, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            ids.setdefault(ch.index, []).extend(getattr(ch, "token_ids", None) or [])
            for lp in ch.logprobs.content if ch.logprobs else []:
                assert len(lp.top_logprobs) == kw.get("top_logprobs", 0)
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return texts, ids, reasons, usage


def test_openai_streaming_chat_equals_the_unstreamed_answer(oai):
    """Same seed: the streamed text and tokens are exactly the unstreamed ones; include_usage adds the usage."""
    c, name = oai
    kw = {
        "n": 2,
        "max_tokens": 12,
        "seed": 21,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"return_token_ids": True},
    }
    whole = c.chat.completions.create(model=name, messages=CHAT, **kw)
    texts, ids, reasons, usage = _chat_stream(c, name, stream_options={"include_usage": True}, **kw)
    for ch in whole.choices:
        assert texts[ch.index] == ch.message.content and ids[ch.index] == ch.token_ids
        assert reasons[ch.index] == ch.finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_openai_streaming_completions_with_stop_strings(oai):
    """A stop string cut from an earlier answer ends the text before it, streamed or not."""
    c, name = oai
    kw = {"model": name, "prompt": "rev:abcdefgh=", "max_tokens": 16, "seed": 3, "extra_body": {"ignore_eos": True}}
    full = c.completions.create(**kw).choices[0].text
    assert len(full) >= 6
    stop = full[3:5]
    cut = full[: full.find(stop)]
    stopped = c.completions.create(stop=[stop], **kw).choices[0]
    assert stopped.text == cut and stopped.finish_reason == "stop"
    chunks = list(c.completions.create(stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)) == full


def test_openai_min_tokens_and_ignore_eos_fix_the_length(oai):
    c, name = oai
    for extra in ({"min_tokens": 7}, {"ignore_eos": True}):
        r = c.completions.create(
            model=name, prompt="x=", max_tokens=7, n=4, seed=1, extra_body={"return_token_ids": True, **extra}
        )
        assert [len(ch.token_ids) for ch in r.choices] == [7] * 4, extra


def test_openai_errors_are_explicit(oai, server):
    import openai

    c, name = oai
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        c.completions.create(model=name, prompt="x=", max_tokens=2, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model=name, prompt="x=", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        c.completions.create(model=name, prompt="x=", max_tokens=2, extra_body={"repetition_penalty": 1.1})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    (card,) = c.models.list().data
    assert card.id == name and card.max_model_len == MODEL.max_seq_len
    paths = server[0].get("/openapi.json").json()["paths"]
    assert {"400", "404", "413", "429", "503"} <= set(paths["/v1/completions"]["post"]["responses"])
    assert {"401", "409", "422"} <= set(paths["/update_weights"]["post"]["responses"])
    assert "422" not in paths["/v1/completions"]["post"]["responses"]  # a body that does not validate is a 400


def _aborted_and_idle(client: httpx.Client, aborted: int) -> dict:
    """Wait (bounded) until the engine has aborted `aborted` requests and stopped producing tokens."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.get("/health").json()["stats"]
        if stats["aborted"] >= aborted:
            time.sleep(0.5)
            later = client.get("/health").json()["stats"]
            if later["tokens"] == stats["tokens"]:
                return later
        time.sleep(0.1)
    raise AssertionError(f"the engine did not abort {aborted} request(s): {client.get('/health').json()}")


def test_a_client_that_goes_away_stops_its_request(server):
    """A streaming client that closes after the first chunk, and a client that stops waiting for a
    non-streamed body: their requests (256 rows x 1000 tokens each, several seconds of work) leave the batch
    instead of running on."""
    client, _, _ = server
    before = client.get("/health").json()["stats"]
    body = {"prompt": [1, 5], "n": 256, "max_tokens": 1000, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first token's chunk, then the client hangs up
    stats = _aborted_and_idle(client, before["aborted"] + 1)
    assert stats["tokens"] - before["tokens"] < 256 * 1000 / 2
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=client.base_url, timeout=0.5) as impatient:
        impatient.post("/v1/completions", json=body)
    after = _aborted_and_idle(client, before["aborted"] + 2)
    assert after["tokens"] - stats["tokens"] < 256 * 1000 / 2
    print(f"tokens drawn before the abort: streamed {stats['tokens'] - before['tokens']}, "
          f"unstreamed {after['tokens'] - stats['tokens']} (of {256 * 1000} each)")  # fmt: skip
    assert client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2}).status_code == 200
