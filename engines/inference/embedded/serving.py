"""The embedded engine's side of a generation: an OpenAI request in, the engine's completions out.

A request (engines/protocol.py, checked by the front end) is checked against the model and turned into an
engine `Request` (its token limit, its stop strings as a check the engine runs after each token, its images); the
completions come back as one response body, or, with `stream=true`, as stream chunks: one per new piece
of a choice's text, each choice's last chunk with its finish_reason and policy versions, and an optional
usage chunk (the front end frames them and adds `[DONE]`). Text is decoded incrementally (`Detokenizer`: a
token's cost does not grow with the completion; the whole token list is decoded once, at a choice's end), so
a character split across tokens is sent once complete, and text that could still become a stop string is
held back until it cannot.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from engines import protocol as api
from engines.inference.backend import BackendError, Generation
from engines.inference.embedded.engine import Completion, Engine, Request, TokenEvents
from engines.models import vision


def cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` up to the first stop string, and that string (None if none occurs)."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    at, stop = min(hits)
    return text[:at], stop


class Detokenizer:
    """A row's text, decoded incrementally as vLLM detokenizes: each call decodes only the tokens since the last
    complete character, with the ones before them as context, so a token costs the same however long the row."""

    PENDING = 8  # tokens without new text (special ones, split characters) after which their text is taken as is

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.prefix = self.read = 0  # context starts at ids[prefix]; the text of ids[:read] was returned

    def new_text(self, ids: list[int]) -> str:
        """The text `ids` (the row's tokens so far) add to what earlier calls returned; "" while a character is
        still split across tokens."""
        before = self.tok.decode(ids[self.prefix : self.read])
        now = self.tok.decode(ids[self.prefix :])
        if (len(now) <= len(before) or now.endswith("\ufffd")) and len(ids) - self.read < self.PENDING:
            return ""
        self.prefix, self.read = self.read, len(ids)
        return now[len(before) :]


class StopMatcher:
    """One row's stop-string check, which the engine runs after each of its tokens: the row's new text
    (`Detokenizer`) and the `longest - 1` characters before it are searched, so a token costs the same however
    long the row or its stop strings (up to MAX_STOP_CHARS)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.text, self.stops = Detokenizer(tokenizer), stops
        self.keep = max(len(s) for s in stops) - 1  # characters a stop string may reach back before new text
        self.tail = ""  # the last `keep` characters of the row's text

    def __call__(self, ids: list[int]) -> bool:
        new = self.text.new_text(ids)
        if not new:
            return False
        window = self.tail + new
        self.tail = window[-self.keep :] if self.keep else ""
        return any(s in window for s in self.stops)


def stop_check(tokenizer, stops: list[str]) -> Callable[[], Callable[[list[int]], bool]] | None:
    """What makes each row's stop check (None without stop strings): a matcher per row, as it keeps state."""
    if not stops:
        return None
    return lambda: StopMatcher(tokenizer, stops)


def _message(m: api.ChatMessage) -> dict:
    """A chat message as the chat template takes it: text, or (with images) its parts as {"type": "image"} and
    {"type": "text", "text": ...} (the image bytes travel apart, in `Generation.images`)."""
    if not m.images():
        return {"role": m.role, "content": m.text()}
    parts = [{"type": "text", "text": p.text} if isinstance(p, api.TextPart) else {"type": "image"} for p in m.content]
    return {"role": m.role, "content": parts}


def _top_k(body: api.SamplingFields) -> int:
    """How many alternatives per position the request asks for."""
    if isinstance(body, api.CompletionRequest):
        return body.logprobs or 0
    assert isinstance(body, api.ChatRequest)
    return (body.top_logprobs or 0) if body.logprobs else 0


@dataclass
class Prepared:
    """A checked request: its prompt ids, the engine request, and what the response needs."""

    body: api.CompletionRequest | api.ChatRequest
    prompt_ids: list[int]
    request: Request
    chat: bool
    id: str
    created: int
    model: str = ""  # the response's `model` (a shared server: the tenant's name); "" the served name


class Serving:
    def __init__(self, engine: Engine, tokenizer, model_name: str):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self._texts: dict[int, str] = {}  # a token's own text, at most one entry per vocabulary id

    @property
    def max_model_len(self) -> int:
        return int(self.engine.model.cfg.max_seq_len)

    def prompt_ids(self, body: api.CompletionRequest | api.ChatRequest, images: tuple[bytes, ...] = ()) -> list[int]:
        """The prompt's token ids; a chat's images become their placeholders (the chat template's image parts),
        each widened to its image's token count (vision.py `expand`)."""
        if isinstance(body, api.ChatRequest):
            ids = self.tok.render_messages([_message(m) for m in body.messages])
            if images and (spec := self.vision_spec):
                ids = vision.expand(ids, [vision.image_size(b) for b in images], spec)
            return ids
        return self.tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)

    @property
    def vision_spec(self) -> vision.VisionSpec | None:
        return getattr(self.engine.model, "vision_spec", None)

    def prepare(self, gen: Generation) -> Prepared:
        """Refuse (400) what would fail or blow up inside a shared batch, before it is queued."""
        body = gen.body
        try:
            ids = self.prompt_ids(body, gen.images)
            if (spec := self.vision_spec) is not None:  # image token runs: one per image, of its size
                vision.check_prompt(ids, [vision.image_size(b) for b in gen.images], spec)
        except vision.ImageError as exc:
            raise BackendError(400, str(exc), "images") from None
        limit = getattr(body, "max_completion_tokens", None) or body.max_tokens or self.max_model_len - len(ids)
        problem = None
        if not ids:
            problem = "prompt is empty"
        elif min(ids) < 0 or max(ids) >= self.engine.model.vocab_size:
            problem = f"prompt token ids must be in [0, {self.engine.model.vocab_size})"
        elif limit <= 0 or len(ids) + limit > self.max_model_len:
            problem = f"prompt ({len(ids)} tokens) + max_tokens ({limit}) exceeds max_model_len {self.max_model_len}"
        elif body.n > self.engine.max_batch_size:
            problem = f"n={body.n} exceeds the engine's max_batch_size {self.engine.max_batch_size}"
        elif (body.min_tokens or 0) > limit:
            problem = f"min_tokens ({body.min_tokens}) exceeds max_tokens ({limit})"
        if problem:
            raise BackendError(400, problem)
        temperature = body.temperature if body.temperature >= api.GREEDY_BELOW else 0.0
        request = Request(
            ids, body.n, limit, temperature, body.seed, top_k=max(body.top_k or 0, 0), top_p=body.top_p or 1.0,
            min_tokens=body.min_tokens or 0, ignore_eos=bool(body.ignore_eos), stop=stop_check(self.tok, body.stops()),
            top_logprobs=_top_k(body), kept_sizes=bool(body.return_kept_sizes),
            prompt_logprobs=getattr(body, "prompt_logprobs", None), images=gen.images,
        )  # fmt: skip
        return Prepared(body, ids, request, gen.chat, gen.id, gen.created)

    async def run(self, p: Prepared) -> list[Completion]:
        """The request's completions; cancelled (its client went away), it is aborted in the engine."""
        # shielded: cancelling the engine's own future would make its later result an error in the engine thread
        future = asyncio.wrap_future(self.engine.submit(p.request))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.engine.abort(p.request)
            raise

    def _token(self, t: int) -> str:
        """A token's text alone (logprobs' `tokens` and `top_logprobs` keys): decoded once per id, as every
        response names most of its tokens again."""
        text = self._texts.get(t)
        if text is None:
            text = self._texts[t] = self.tok.decode([t], skip_special=False)
        return text

    def usage(self, p: Prepared, outs: list[Completion]) -> api.Usage:
        done = sum(len(c.token_ids) for c in outs)
        return api.Usage(prompt_tokens=len(p.prompt_ids), completion_tokens=done, total_tokens=len(p.prompt_ids) + done)

    def _finish(self, i: int, c: Completion, body: api.CompletionRequest | api.ChatRequest) -> tuple[str, dict]:
        """The text of a finished completion, and the fields its choice has on both routes."""
        text, stop = cut(self.tok.decode(c.token_ids), body.stops())
        return text, {
            "index": i,
            "finish_reason": "stop" if stop else c.finish_reason,
            "stop_reason": stop,
            "token_ids": c.token_ids if body.return_token_ids else None,
            "policy_version": c.policy_version,
            "policy_version_end": c.policy_version_end,
            "routed_experts": c.routed_experts.tolist()
            if c.routed_experts is not None and body.return_routed_experts
            else None,
            "kept_sizes": c.kept_sizes if body.return_kept_sizes else None,
        }

    def completion(self, p: Prepared, outs: list[Completion]) -> api.CompletionResponse:
        body = p.body
        assert isinstance(body, api.CompletionRequest)
        choices = []
        for i, c in enumerate(outs):
            text, common = self._finish(i, c, body)
            logprobs = None
            if body.logprobs is not None:
                tokens = [self._token(t) for t in c.token_ids]
                offsets = [0, *itertools.accumulate(len(x) for x in tokens[:-1])] if tokens else []
                top = [self._top_dict(alts) for alts in c.top_logprobs] if body.logprobs else None
                logprobs = api.CompletionLogprobs(
                    tokens=tokens, token_logprobs=c.logprobs, text_offset=offsets, top_logprobs=top
                )
            choices.append(
                api.CompletionChoice(
                    text=text,
                    logprobs=logprobs,
                    prompt_token_ids=p.prompt_ids if body.return_token_ids else None,
                    prompt_logprobs=self._prompt_logprobs(p.prompt_ids, c),
                    **common,
                )
            )
        return api.CompletionResponse(
            id=f"cmpl-{p.id}",
            created=p.created,
            model=p.model or self.model_name,
            choices=choices,
            usage=self.usage(p, outs),
        )

    def chat(self, p: Prepared, outs: list[Completion]) -> api.ChatResponse:
        body = p.body
        assert isinstance(body, api.ChatRequest)
        choices = []
        for i, c in enumerate(outs):
            text, common = self._finish(i, c, body)
            tops: list[list[tuple[int, float]] | None] = list(c.top_logprobs) or [None] * len(c.token_ids)
            lps = [self._chat_logprob(t, lp, a) for t, lp, a in zip(c.token_ids, c.logprobs, tops, strict=True)]
            choices.append(
                api.ChatChoice(
                    message=api.ChatMessage(role="assistant", content=text),
                    logprobs=api.ChatChoiceLogprobs(content=lps) if body.logprobs else None,
                    **common,
                )
            )
        return api.ChatResponse(
            id=f"chatcmpl-{p.id}", created=p.created, model=p.model or self.model_name, choices=choices,
            usage=self.usage(p, outs), prompt_token_ids=p.prompt_ids if body.return_token_ids else None,
        )  # fmt: skip

    def _chat_logprob(self, t: int, lp: float, alts: list[tuple[int, float]] | None) -> api.ChatLogprob:
        token = self._token(t)
        top = [api.TopLogprob(token=(x := self._token(a)), logprob=v, bytes=list(x.encode())) for a, v in alts or []]
        return api.ChatLogprob(token=token, logprob=lp, bytes=list(token.encode()), top_logprobs=top)

    def _prompt_logprobs(self, ids: list[int], c: Completion) -> list[dict[str, api.PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs`: null for the first token, then {token id: its score} with the alternatives."""
        if c.prompt_logprobs is None:
            return None
        out: list[dict[str, api.PromptLogprob] | None] = [None]
        for t, (lp, rank, alts) in zip(ids[1:], c.prompt_logprobs, strict=True):
            entry = {str(t): api.PromptLogprob(logprob=lp, rank=rank, decoded_token=self._token(t))}
            for i, (a, v) in enumerate(alts):
                entry.setdefault(str(a), api.PromptLogprob(logprob=v, rank=i + 1, decoded_token=self._token(a)))
            out.append(entry)
        return out

    def _top_dict(self, alts: list[tuple[int, float]]) -> dict[str, float]:
        return {self._token(a): v for a, v in alts}

    async def stream(self, p: Prepared) -> AsyncGenerator[dict, None]:
        """The stream chunks of one request (see the module docstring). The request is aborted when the
        front end closes or cancels this generator early (its client went away)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvents] = asyncio.Queue()

        def on_tokens(events: TokenEvents) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(queue.put_nowait, events)

        p.request.on_tokens = on_tokens
        done = asyncio.ensure_future(self.run(p))
        try:
            async for chunk in self._chunks(p, queue, done):
                yield chunk
        finally:
            if not done.done():
                self.engine.abort(p.request)

    async def _chunks(self, p: Prepared, queue: asyncio.Queue, done: asyncio.Future) -> AsyncIterator[dict]:
        texts = _Texts(self, p)
        if p.chat:
            yield texts.chat_first()
        while True:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                break
            for chunk in texts.chunks(get.result()):
                yield chunk
        while not queue.empty():  # events delivered just before the request resolved
            for chunk in texts.chunks(queue.get_nowait()):
                yield chunk
        outs = done.result()  # an engine error: the front end sends it as an error event
        if p.body.stream_options and p.body.stream_options.include_usage:
            yield {**texts.head(), "choices": [], "usage": self.usage(p, outs).model_dump()}


class _Texts:
    """Per choice of a streamed request: its tokens, the text sent so far, its first policy version."""

    def __init__(self, serving: Serving, p: Prepared):
        self.s, self.p = serving, p
        self.stops = p.body.stops()
        self.hold = max((len(x) for x in self.stops), default=1) - 1  # text that may still be a stop's start
        n = p.body.n
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.texts = [Detokenizer(serving.tok) for _ in range(n)]
        self.unsent = [""] * n  # decoded, not sent yet: held back (a stop's possible start, a partial character)
        self.sent = [0] * n  # characters sent
        self.ended = [False] * n
        self.first_version: list[int | None] = [None] * n

    def head(self) -> dict:
        model = self.p.model or self.s.model_name
        if self.p.chat:
            return {"id": f"chatcmpl-{self.p.id}", "object": "chat.completion.chunk", "created": self.p.created,
                    "model": model}  # fmt: skip
        return {"id": f"cmpl-{self.p.id}", "object": "text_completion", "created": self.p.created,
                "model": model}  # fmt: skip

    def chat_first(self) -> dict:
        first = {**self.head(), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.p.body.n)
        ]}  # fmt: skip
        if self.p.body.return_token_ids:
            first["prompt_token_ids"] = self.p.prompt_ids
        return first

    def chunks(self, events: TokenEvents) -> list[dict]:
        return [c for e in events if (c := self._chunk(*e)) is not None]

    def _delta(self, i: int, finished: bool) -> tuple[str, str | None, bool]:
        """Choice i's text to send now, the stop string that ended it, and whether it ended. Only its new text is
        decoded and searched (a stop string starts within the held-back text); at the end the whole text is
        decoded once, so the streamed text is the unstreamed answer's."""
        self.unsent[i] += self.texts[i].new_text(self.ids[i])
        stop = next((s for s in self.stops if s in self.unsent[i]), None)
        if finished or stop is not None:
            full, stop = cut(self.s.tok.decode(self.ids[i]), self.stops)
            delta = full[self.sent[i] :]
        else:
            delta = self.unsent[i][: max(0, len(self.unsent[i]) - self.hold)].rstrip("\ufffd")  # no partial characters
            self.unsent[i] = self.unsent[i][len(delta) :]
        self.sent[i] += len(delta)
        return delta, stop, finished or stop is not None

    def _chunk(
        self, i: int, token: int, logprob: float, finished: bool, version: int, reason: str, alts
    ) -> dict | None:
        if self.ended[i]:
            return None  # a stop string ended its text; the engine's row may still have drawn this token
        if self.first_version[i] is None:
            self.first_version[i] = version
        self.ids[i].append(token)
        delta, stop, end = self._delta(i, finished)
        choice: dict = {"index": i, "finish_reason": None, "logprobs": None}
        body = self.p.body
        assert isinstance(body, api.ChatRequest | api.CompletionRequest)
        if self.p.chat:
            choice["delta"] = {"content": delta}
            if body.logprobs:
                choice["logprobs"] = {"content": [self.s._chat_logprob(token, logprob, alts).model_dump()]}
        else:
            choice["text"] = delta
            if body.logprobs is not None:
                offset = self.sent[i] - len(delta)
                choice["logprobs"] = {"tokens": [self.s._token(token)], "token_logprobs": [logprob],
                                      "text_offset": [offset],
                                      "top_logprobs": [self.s._top_dict(alts)] if alts else None}  # fmt: skip
            if body.return_token_ids and len(self.ids[i]) == 1:
                choice["prompt_token_ids"] = self.p.prompt_ids  # per choice, on its first chunk (vLLM)
        if body.return_token_ids:
            choice["token_ids"] = [token]
        if end:
            self.ended[i] = True
            choice.update(finish_reason="stop" if stop else reason, stop_reason=stop)
            choice.update(policy_version=self.first_version[i], policy_version_end=version)
        return {**self.head(), "choices": [choice]}
