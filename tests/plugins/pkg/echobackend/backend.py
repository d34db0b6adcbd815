"""The echo backend: a completion is the prompt's tokens repeated up to `max_tokens` (the vocabulary is
Unicode code points: text encodes as `ord` of each character, a chat as `role: content` lines), every
token with logprob LOGPROB. A weight update only changes the version it reports.

ECHO_DELAY_S in the environment makes each token take that long, so a test can leave mid-request; the
requests the front end stopped that way are counted in /health's `stats.aborted`.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator

from engines import protocol as api
from engines.inference.backend import Backend, BackendError, Generation, served_name

LOGPROB = math.log(0.5)


def prompt_ids(body: api.CompletionRequest | api.ChatRequest) -> list[int]:
    if isinstance(body, api.ChatRequest):
        return [ord(c) for c in "\n".join(f"{m.role}: {m.content}" for m in body.messages)]
    return [ord(c) for c in body.prompt] if isinstance(body.prompt, str) else list(body.prompt)


class EchoBackend(Backend):
    def __init__(self, model_name: str, max_model_len: int, delay_s: float = 0.0):
        self.model_name, self.max_model_len, self.delay_s = model_name, max_model_len, delay_s
        self.version = 0
        self.stats = {"requests": 0, "aborted": 0}

    def _tokens(self, gen: Generation) -> tuple[list[int], list[int]]:
        prompt = prompt_ids(gen.body)
        if not prompt or any(t < 0 or t > 0x10FFFF for t in prompt):
            raise BackendError(400, "prompt must be non-empty code points in [0, 0x10FFFF]", "prompt")
        limit = getattr(gen.body, "max_completion_tokens", None) or gen.body.max_tokens or 16
        if len(prompt) + limit > self.max_model_len:
            raise BackendError(400, f"prompt + max_tokens exceeds max_model_len {self.max_model_len}", "max_tokens")
        self.stats["requests"] += 1
        return prompt, [prompt[i % len(prompt)] for i in range(limit)]

    def _choice(self, gen: Generation, i: int, prompt: list[int], ids: list[int]) -> dict:
        body, text = gen.body, "".join(map(chr, ids))
        choice = {"index": i, "finish_reason": "length", "policy_version": self.version,
                  "policy_version_end": self.version, "token_ids": ids if body.return_token_ids else None}  # fmt: skip
        if gen.chat:
            choice["message"] = {"role": "assistant", "content": text}
            lps = [{"token": chr(t), "logprob": LOGPROB, "top_logprobs": []} for t in ids]
            choice["logprobs"] = {"content": lps} if body.logprobs else None
        else:
            choice["text"] = text
            offsets = list(range(len(ids)))
            choice["logprobs"] = (
                {"tokens": list(text), "token_logprobs": [LOGPROB] * len(ids), "text_offset": offsets}
                if body.logprobs is not None
                else None
            )
            choice["prompt_token_ids"] = prompt if body.return_token_ids else None
        return choice

    def _usage(self, prompt: list[int], done: int) -> dict:
        return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

    async def generate(self, gen: Generation) -> api.CompletionResponse | api.ChatResponse:
        prompt, ids = self._tokens(gen)
        try:
            await asyncio.sleep(self.delay_s * len(ids))
        except asyncio.CancelledError:
            self.stats["aborted"] += 1
            raise
        choices = [self._choice(gen, i, prompt, ids) for i in range(gen.body.n)]
        usage = self._usage(prompt, len(ids) * gen.body.n)
        if gen.chat:
            return api.ChatResponse(id=f"chatcmpl-{gen.id}", created=gen.created, model=self.model_name,
                                    choices=choices, usage=usage)  # type: ignore[arg-type]  # fmt: skip
        return api.CompletionResponse(id=f"cmpl-{gen.id}", created=gen.created, model=self.model_name,
                                      choices=choices, usage=usage)  # type: ignore[arg-type]  # fmt: skip

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        prompt, ids = self._tokens(gen)
        kind = "chat.completion.chunk" if gen.chat else "text_completion"
        head = {"id": gen.id, "object": kind, "created": gen.created, "model": self.model_name}
        sent = 0
        try:
            for k, t in enumerate(ids):
                await asyncio.sleep(self.delay_s)
                for i in range(gen.body.n):
                    yield {**head, "choices": [self._chunk_choice(gen, i, t, last=k == len(ids) - 1)]}
                sent = k + 1
        finally:
            if sent < len(ids):
                self.stats["aborted"] += 1
        if gen.body.stream_options and gen.body.stream_options.include_usage:
            yield {**head, "choices": [], "usage": self._usage(prompt, len(ids) * gen.body.n)}

    def _chunk_choice(self, gen: Generation, i: int, token: int, last: bool) -> dict:
        piece = {"delta": {"content": chr(token)}} if gen.chat else {"text": chr(token)}
        choice = {"index": i, **piece, "finish_reason": "length" if last else None}
        if gen.body.return_token_ids:
            choice["token_ids"] = [token]
        if last:
            choice |= {"policy_version": self.version, "policy_version_end": self.version}
        return choice

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        if req.version is None:
            raise BackendError(400, "the echo backend takes versions, not paths", "path")
        if req.version < self.version:
            raise BackendError(409, f"version {req.version} is older than the served {self.version}")
        self.version = req.version
        return api.UpdateWeightsResponse(policy_version=self.version, load_s=0.0, apply_s=0.0)

    async def health(self) -> api.HealthResponse:
        return api.HealthResponse(status="ok", policy_version=self.version, stats=self.stats)


async def create(cfg) -> EchoBackend:
    """The backend of an InferenceProcessConfig (engines/inference/backend.py `create` calls this)."""
    return EchoBackend(served_name(cfg), cfg.model.max_seq_len, float(os.environ.get("ECHO_DELAY_S", "0")))
