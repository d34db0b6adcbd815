"""The verifiers model client rollflow installs for verifiers environments (engines/environments/verifiers_env.py).

verifiers' interception server hands every model call of a rollout to its `Client` with the rollout's
trace id as `session_id`. `TokenClient` keeps one `engines.environments.episodes.Episode` per session and extends it in
token ids only: turn 1 renders the request's messages with the chat template; later turns append the
messages that followed the last reply (tool results, a user turn) through `Tokenizer.render_continuation`
to the ids already sampled, never re-rendering the conversation. It samples through the orchestrator's
group (a `GroupSampler`, engines/environments/episodes.py: one request per turn to `/v1/completions` with
the session's id in the configured session header, a seed that is a pure function of run seed, step, group,
episode and turn) and returns a verifiers `Response` whose `tokens` are the server's ids and logprobs, with
tool calls parsed by the environment's `tool_parser`. A streamed request (`stream=True`, what verifiers'
shipped `null` and `bash` harnesses send) reaches `relay`, which samples the turn the same way and frames
it as OpenAI SSE events (engines/environments/verifiers_stream.py); the episode is built from the server's
ids either way. `install_client` also prepares verifiers' chat program to run on this interpreter
(engines/environments/verifiers_programs.py), so those harnesses start without `uv` or a package index.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verifiers.v1.clients import Client, EvalClientConfig, ModelContext
from verifiers.v1.clients.client import RelayReply
from verifiers.v1.clients.train import serialize_completion
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.types import AssistantMessage, Response, ToolCall, TurnTokens, Usage

from engines.environments.episodes import Episode, GroupSampler
from engines.environments.verifiers_programs import use_local_interpreter
from engines.environments.verifiers_stream import relay_reply
from storage import rollouts

log = logging.getLogger("rollflow.orchestrator")


@dataclass
class _Session:
    k: int
    group_id: str
    step: int
    group: int
    header: str  # the episode's session id toward rollflow's server (`run_id/sample_id`, as multiturn.py)
    episode: Episode | None = None
    seen: int = 0  # messages of the conversation already in `episode`: the prompt's and each reply

    @property
    def sample_id(self) -> str:
        return rollouts.sample_id(self.group_id, self.k)


@dataclass
class Installed:
    model_context: ModelContext
    client_object: TokenClient


def _content(message: dict) -> dict:
    """A wire message as the chat template sees it: text content (tool results included)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message["role"], "content": content or ""}


class TokenClient(Client):
    def __init__(
        self, group: GroupSampler, tool_parser: Callable[[str], list[tuple[str, str]]] | None, record: str | None
    ):
        self.group, self.tool_parser, self.record = group, tool_parser, record
        self.tok, self.temperature = group.tok, group.temperature
        self.sessions: dict[str, _Session] = {}
        self._call_ids = itertools.count()

    def bind(self, session_id: str, k: int, group_id: str, step: int, group: int, run_id: str) -> None:
        """The trace `session_id` is episode `k` of a group (verifiers mints the trace, and calls this,
        before the rollout's first model call)."""
        self.sessions[session_id] = _Session(k, group_id, step, group, f"{run_id}/{rollouts.sample_id(group_id, k)}")

    def finish(self, session_id: str) -> Episode:
        s = self.sessions.pop(session_id)
        if s.episode is None:
            raise RuntimeError(f"verifiers episode {s.sample_id} made no model call")
        s.episode.text = self.tok.decode(s.episode.completion_ids, skip_special=False)
        return s.episode

    def _extend(self, s: _Session, messages: list[dict]) -> None:
        wire = [_content(m) for m in messages]
        if s.episode is None:
            s.episode = Episode(prompt_ids=self.tok.render_messages(wire))
            return
        last = messages[s.seen - 1] if 0 < s.seen < len(messages) else None
        if last is None or last.get("role") != "assistant":
            raise RuntimeError(
                f"verifiers session {s.sample_id}: the conversation does not extend the last sampled "
                "reply (rewritten history cannot be trained on without re-tokenizing)"
            )
        s.episode.add_environment(self.tok.render_continuation(wire[s.seen :]))

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        return await self._turn(dialect, body, session_id)

    async def relay(
        self,
        dialect: Any,
        body: dict,
        session_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RelayReply:
        """A streamed request (`stream=True`, as verifiers' `null` and `bash` harnesses send): the turn is
        sampled exactly as `get_response` samples it, then framed as OpenAI SSE events
        (engines/environments/verifiers_stream.py)."""
        response = await self._turn(dialect, body, session_id)
        assert response.raw is not None
        return relay_reply(response.raw, body)

    async def _turn(self, dialect: Any, body: dict, session_id: str | None) -> Response:
        """One model turn of session `session_id`: extend its episode's ids with the request's new messages,
        sample from them, record the server's choice in the episode."""
        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(f"rollflow's verifiers client serves chat completions only, not {dialect!r}")
        if session_id not in self.sessions:
            raise RuntimeError(f"verifiers session {session_id!r} was not bound to an episode of this group")
        s = self.sessions[session_id]
        messages = [message_to_wire(m) for m in dialect.parse_request(body).messages]
        self._extend(s, messages)
        assert s.episode is not None
        e, turn_no = s.episode, len(s.episode.turn_versions)
        before = list(e.context)
        room = self.group.max_seq_len - len(before)
        if room < 1:
            raise RuntimeError(f"episode {s.sample_id}: no room in model.max_seq_len for turn {turn_no + 1}")
        build = self.group.request(s.step, s.group, s.k)
        choice = await self.group.sample(build(before, room, turn_no), s.header)
        e.add_turn(choice)
        s.seen = len(messages) + 1
        if self.record:
            self._record(self.record, s.sample_id, turn_no, before, choice)
        return self._response(choice, before, body.get("model", ""))

    def _record(self, path: str, sample_id: str, turn: int, prompt: list[int], choice: Any) -> None:
        """One line per model turn: the ids sent and the server's choice as received, for audits."""
        line = {"sample_id": sample_id, "turn": turn, "prompt": prompt, "choice": choice.model_dump(mode="json")}
        with open(path, "a") as f:  # noqa: ASYNC230 - a small append per turn, audit-only
            f.write(json.dumps(line) + "\n")

    def _response(self, choice: Any, prompt_ids: list[int], model: str) -> Response:
        calls = self.tool_parser(choice.text) if self.tool_parser else []  # a truncated reply may call too
        tool_calls = [ToolCall(id=f"call_{next(self._call_ids)}", name=n, arguments=a) for n, a in calls] or None
        finish = "tool_calls" if tool_calls else ("length" if choice.finish_reason == "length" else "stop")
        response = Response(
            id=f"rollflow-{next(self._call_ids)}",
            created=0,
            model=model,
            message=AssistantMessage(content=None if tool_calls else choice.text, tool_calls=tool_calls),
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(choice.token_ids)),
            tokens=TurnTokens(
                prompt_ids=prompt_ids,
                completion_ids=list(choice.token_ids),
                completion_logprobs=list(choice.logprobs.token_logprobs),
            ),
        )
        response.raw = serialize_completion(response, model)
        return response


def install_client(env: Any, client: TokenClient, model: str) -> Installed:
    """Make `client` the model client of every rollout of `env` (which is serving): the interception
    server keeps one client per client config, so it is registered under the config the rollouts use."""
    from verifiers.v1.interception.server import InterceptionServer

    server = getattr(env, "_interception", None)
    if not isinstance(server, InterceptionServer):
        raise RuntimeError(
            "rollflow runs verifiers environments with one in-process interception server: set the env's "
            f"`interception = InterceptionServerConfig()` (it has {type(server).__name__})"
        )
    try:  # verifiers' null/bash harnesses: their program on this interpreter, no uv or index needed
        use_local_interpreter()
    except RuntimeError as e:
        log.warning("%s; verifiers will prepare it with uv instead (needs uv and the package index)", e)
    config = EvalClientConfig(base_url="http://127.0.0.1/rollflow-token-client", api_key_var="ROLLFLOW_VERIFIERS_KEY")
    server.clients[config.model_dump_json()] = client
    return Installed(ModelContext(model=model, client=config), client)
