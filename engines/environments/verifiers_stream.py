"""Streamed chat completions for verifiers harnesses: one sampled turn framed as OpenAI SSE events.

verifiers' shipped chat program (the `null` and `bash` harnesses) asks for every model turn with
`stream=True` (and `stream_options.include_usage`). verifiers' interception server hands a streamed
request of an eval client to `Client.relay`, reads the returned events whole (its `_collect_stream`),
commits the turn, and only then serves the same events to the harness. rollflow's `TokenClient`
(engines/environments/verifiers_client.py) samples the turn exactly as for a non-streamed request (ids
in, the server's ids and logprobs out, recorded in the episode) and `relay_reply` frames the finished
turn, the `chat.completion` dict `serialize_completion` made of it, as the events OpenAI's API streams:

1. a role chunk (`delta = {"role": "assistant", "content": ""}`, content null for a tool-call-only reply),
2. the reply's text as one content delta (when the turn has text),
3. one delta per tool call (`index`, `id`, `type`, `function.name`, `function.arguments`),
4. a closing chunk with an empty delta and the `finish_reason`,
5. with `include_usage`, a usage chunk (`choices: []`); every earlier chunk then has `"usage": null`,
6. `data: [DONE]`.

The text goes as one delta because the turn is sampled whole (one `/v1/completions` request) and the
interception server buffers a stream until its turn commits anyway: splitting it would only imitate
token-by-token timing. What the harness reads is what was sampled; what rollflow trains on never passes
through this text (the episode holds the server's ids). verifiers' own trace of a streamed turn is what its
stream parser assembles from these events, so it carries the text and tool calls but no token ids.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

from verifiers.v1.clients.client import RelayReply

DONE = b"data: [DONE]\n\n"


def _chunk(raw: dict, choices: list[dict], include_usage: bool) -> dict:
    chunk = {
        "id": raw.get("id", "rollflow"),
        "object": "chat.completion.chunk",
        "created": raw.get("created", 0),
        "model": raw.get("model", ""),
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def _choice(delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _tool_call_deltas(message: dict) -> list[dict]:
    return [
        {
            "index": i,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": call["function"].get("arguments") or ""},
        }
        for i, call in enumerate(message.get("tool_calls") or [])
    ]


def completion_chunks(raw: dict, include_usage: bool) -> list[dict]:
    """The `chat.completion.chunk` objects of one finished `chat.completion` (`raw`), in order."""
    (choice,) = raw["choices"]
    message = choice["message"]
    # as OpenAI's API: a text reply opens with content "", a tool-call-only reply with content null
    deltas: list[dict] = [{"role": "assistant", "content": "" if message.get("content") else None}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    deltas += [{"tool_calls": [call]} for call in _tool_call_deltas(message)]
    chunks = [_chunk(raw, [_choice(d)], include_usage) for d in deltas]
    chunks.append(_chunk(raw, [_choice({}, choice["finish_reason"])], include_usage))
    if include_usage:
        chunks.append({**_chunk(raw, [], False), "usage": raw.get("usage")})
    return chunks


def sse_events(chunks: Iterable[dict]) -> list[bytes]:
    """Each chunk as one complete SSE event, then the `[DONE]` sentinel."""
    return [f"data: {json.dumps(c, separators=(',', ':'))}\n\n".encode() for c in chunks] + [DONE]


def relay_reply(raw: dict, body: dict) -> RelayReply:
    """The events of turn `raw` as verifiers' interception server reads a relayed provider stream: one
    complete SSE event per item of `chunks`."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    events = sse_events(completion_chunks(raw, include_usage))

    async def chunks() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    async def close() -> None:  # nothing is held open: the turn was sampled before the first event
        return None

    return RelayReply(content_type="text/event-stream", chunks=chunks(), close=close)
