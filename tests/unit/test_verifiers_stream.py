"""Streamed chat completions from rollflow's verifiers client (engines/environments/verifiers_stream.py,
verifiers_client.py `relay`), verifiers' chat program on this interpreter (verifiers_programs.py), and the
TextArena factory's refusal when NLTK data is missing (verifiers_textarena.py).

The stream is read by the real `openai` client over a loopback HTTP server, and a streaming harness runs
through verifiers' real interception server; the sampler is scripted (the real inference server is in
tests/integration/test_verifiers_textarena.py)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest
from aiohttp import web
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from config.envs import EnvSpec
from engines.environments import plugins
from engines.environments.verifiers_stream import completion_chunks, relay_reply
from engines.models.tokenizer import CharTokenizer
from engines.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest

VF_ENVS = Path(__file__).resolve().parents[1] / "plugins/vf"
TOK = CharTokenizer()


def _choice(text: str, version: int = 3) -> CompletionChoice:
    ids = TOK.encode(text, bos=False) + [TOK.eos_id]
    return CompletionChoice(
        index=0,
        text=text,
        finish_reason="stop",
        logprobs=CompletionLogprobs(tokens=[""] * len(ids), token_logprobs=[-0.25 * (k + 1) for k in range(len(ids))]),
        token_ids=ids,
        policy_version=version,
        policy_version_end=version,
    )


def _raw(text: str, parser=None) -> dict:
    """The `chat.completion` the token client makes of a sampled choice (tool calls parsed by `parser`)."""
    from engines.environments.verifiers_client import TokenClient

    client = TokenClient(type("G", (), {"tok": TOK, "temperature": 1.0})(), parser, None)  # type: ignore[arg-type]
    response = client._response(_choice(text), [1, 2, 3], "rollflow")
    assert response.raw is not None
    return response.raw


def _calls(text: str) -> list[tuple[str, str]]:
    return [("lookup", json.dumps({"key": text[1:]}))] if text.startswith("?") else []


async def _read_with_openai(events: list[bytes]) -> tuple[list, object]:
    """Serve `events` as an SSE response on 127.0.0.1 and read them with the real `openai` client."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="rollflow", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            state, chunks = ChatCompletionStreamState(), []
            async for chunk in stream:
                chunks.append(chunk)
                state.handle_chunk(chunk)
        return chunks, state.get_final_completion()
    finally:
        await runner.cleanup()


def test_stream_is_openai_chunks_that_the_openai_client_assembles_into_the_turn():
    raw = _raw("?ab", _calls)
    body = {"stream": True, "stream_options": {"include_usage": True}}
    reply = relay_reply(raw, body)

    async def drain() -> list[bytes]:
        return [event async for event in reply.chunks]

    events = asyncio.run(drain())
    assert reply.content_type == "text/event-stream" and events[-1] == b"data: [DONE]\n\n"
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") and e.count(b"\n\n") == 1 for e in events)
    chunks, final = asyncio.run(_read_with_openai(events))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, "tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # include_usage: usage last, alone
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"key": "ab"})
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content is None


def test_stream_of_a_text_reply_carries_exactly_the_sampled_text():
    raw = _raw("hello, world")
    chunks = completion_chunks(raw, include_usage=False)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "hello, world"},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and all("usage" not in c for c in chunks)
    _, final = asyncio.run(_read_with_openai(_sse(chunks)))
    assert final.choices[0].message.content == "hello, world" and final.choices[0].finish_reason == "stop"


def _sse(chunks: list[dict]) -> list[bytes]:
    from engines.environments.verifiers_stream import sse_events

    return sse_events(chunks)


class ScriptedGroup:
    """The orchestrator's group (`GroupSampler`) with a scripted server: turn 0 calls the tool with the key of
    the prompt, turn 1 answers `zz`; every choice's ids, logprobs and version are kept to compare."""

    tok, group_size, temperature, max_seq_len = TOK, 2, 1.0, 64

    def __init__(self) -> None:
        self.sampled: dict[str, list[CompletionChoice]] = {}

    def request(self, step: int, group: int, k: int):
        def build(context: list[int], room: int, turn: int) -> CompletionRequest:
            return CompletionRequest(prompt=context, max_tokens=min(8, room), logprobs=1, return_token_ids=True)

        return build

    async def sample(self, request: CompletionRequest, session_id: str) -> CompletionChoice:
        turns = self.sampled.setdefault(session_id, [])
        key = TOK.decode(request.prompt).split("get:")[1].split("=")[0]
        turns.append(_choice(f"?{key}" if not turns else "zz", version=len(turns)))
        return turns[-1]


def test_streamed_turns_through_verifiers_interception_are_token_exact(monkeypatch):
    """A harness that streams every call (as verifiers' shipped ones do), through verifiers' interception
    server: the episode holds exactly the sampled ids and logprobs (mask 1), the tool answer between them
    (mask 0), and the harness got the turn (its tool call was run, the rubric saw it)."""
    monkeypatch.syspath_prepend(str(VF_ENVS))
    env_args = {"num_tasks": 3, "stream": True}
    args = {"env": "vf_lookup:load_environment", "env_args": env_args, "tool_parser": "vf_tools:parse_calls"}
    env = plugins.build(EnvSpec(id="verifiers", args=args))
    group = ScriptedGroup()

    async def run():
        try:
            return await env.run_group(group, env.sample(random.Random(0)), "run", 1, 0)
        finally:
            await env.close()

    rows = asyncio.run(run())
    assert len(rows) == 2
    for r in rows:
        (first, second) = group.sampled[f"run/{r.sample_id}"]
        tool = TOK.render_continuation([{"role": "tool", "content": f"is:{_value(env, r)}"}])
        assert r.completion_ids == first.token_ids + tool + second.token_ids
        assert r.completion_mask == [1] * len(first.token_ids) + [0] * len(tool) + [1] * len(second.token_ids)
        lps = first.logprobs.token_logprobs + [0.0] * len(tool) + second.logprobs.token_logprobs
        assert r.completion_logprobs == lps and r.turn_policy_versions == [0, 1]
        scores = dict(zip(r.metric_names, r.metric_values, strict=True))
        assert scores["metric/tool_calls"] == 1.0 and scores["reward/called_key"] == 0.5  # weight 0.5, exact key


def _value(env, row) -> str:
    """The lookup tool's answer for the row's task."""
    from vf_tools import value

    data = next(t.data for t in env.tasks if t.data.prompt == row.prompt_text)
    return value(data.salt, data.key)


def test_chat_program_runs_on_this_interpreter_without_uv():
    """verifiers' subprocess runtime finds its chat program prepared: the argv it returns runs this
    interpreter on the program, and `uv` is never looked for."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    from engines.environments.verifiers_programs import script_requirements, unmet, use_local_interpreter

    path = use_local_interpreter()
    assert path.read_text() == CHAT_PROGRAM_SOURCE
    runtime = SubprocessRuntime(SubprocessConfig())

    async def fail(*_a, **_k):
        raise AssertionError("the runtime tried to prepare the script with uv")

    runtime.run = fail  # type: ignore[method-assign]
    argv = asyncio.run(runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, {}, activate=False))
    assert argv == [sys.executable, str(path)]
    assert "mcp==2.0.0" in script_requirements(CHAT_PROGRAM_SOURCE)
    assert unmet(["openai<1", "no-such-package-rollflow"]) == [
        f"openai<1 (installed: {__import__('openai').__version__})",
        "no-such-package-rollflow (not installed)",
    ]


def test_textarena_without_nltk_words_is_refused_naming_game_data_and_fix(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [])  # no NLTK data folder but the one given
    spec = EnvSpec(
        id="verifiers",
        args={
            "env": "engines.environments.verifiers_textarena:load_environment",
            "env_args": {"nltk_data": str(tmp_path)},
        },
    )
    with pytest.raises(plugins.PluginError) as err:
        plugins.check([spec], ["ta.toml"], "tag")
    message = str(err.value)
    assert "ta.toml" in message and "TextArena Hangman-v0" in message and "corpora/words" in message
    assert "python -m engines.environments.verifiers_textarena words DIR" in message and str(tmp_path) in message
