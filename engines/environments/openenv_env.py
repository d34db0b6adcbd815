"""OpenEnv environments as rollflow environments: `[[envs]] id = "openenv"`, `args = {app = "pkg.server.app:app",
...}` (docs/environments.md, "OpenEnv").

The orchestrator starts the app's server itself on 127.0.0.1 (engines/environments/openenv_server.py) when the
first group runs, and stops it when it closes its environments. Each episode is one WebSocket session of
openenv-core's own client (`GenericEnvClient`, a server-side environment instance per session):
`reset(seed, **reset_args)` gives the first observation, whose `observation_field` text is the first prompt
(through the chat template); each model turn's reply (the server's decoded text) is sent as the action
`{action_field: reply}`; the step's observation text is rendered as a `role` message after the reply
(`Tokenizer.render_continuation`) and appended to the ids, until the server says `done`, `max_turns` is reached,
a turn stops on length, or the context has no room left. With a `tool_parser`, a reply it reads as a tool call
is sent as openenv's MCP action instead (`{"type": "call_tool", "tool_name", "arguments"}`, answered by an
`MCPEnvironment`'s tools) and the tool's result is rendered as a `tool_role` message. The episode is built in
token ids exactly as the
inference server returned them (`engines.environments.episodes.Episode`): `completion_mask` 1 on sampled tokens,
0 on observation tokens. Its reward is the sum (or the last, `reward = "last"`) of the steps' rewards. All the
group's episodes reset with the task's seed, a pure function of (run seed, step, group).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engines.environments.base import Task
from engines.environments.episodes import Episode, GroupSampler, RequestBuilder
from engines.environments.openenv_server import OpenEnvServer
from engines.registry import PluginError, import_object
from storage import rollouts
from storage.rollouts import RolloutRow

REWARDS = ("sum", "last")
Parser = Callable[[str], "tuple[str, dict] | None"]  # reply text -> (tool name, arguments), or None: not a call
INSTALL = "install it with `make install` (it installs openenv-core without its web UI dependencies)"


@dataclass(frozen=True)
class OpenEnvTask(Task):
    seed: int = 0  # the reset seed every episode of the task's group uses


@dataclass
class _Played:
    episode: Episode
    first: str  # the reset observation's text: the row's prompt_text
    rewards: list[float]
    done: bool


class OpenEnvEnvironment:
    """A `GroupEnvironment` (engines/environments/episodes.py) over a local OpenEnv server."""

    def __init__(self, name: str, app: str, options: dict[str, Any]):
        self.name, self.app = name, app
        self.action_field: str = options["action_field"]
        self.observation_field: str = options["observation_field"]
        self.role: str = options["role"]
        self.max_turns: int = options["max_turns"]
        self.reset_args: dict = options["reset_args"]
        self.reward_mode: str = options["reward"]
        self.step_timeout_s: float = options["step_timeout_s"]
        self.record: str | None = options["record"]
        self.tool_parser: Parser | None = options["tool_parser"]
        self.tool_role: str = options["tool_role"]
        self.server = OpenEnvServer(name, app, options["startup_timeout_s"], options["log_dir"])
        self.sessions = asyncio.Semaphore(options["max_sessions"])
        self._starting = asyncio.Lock()
        self._failed: PluginError | None = None

    def sample(self, rng: random.Random) -> Task:
        # the prompt is the server's reset observation, known only when an episode starts
        return OpenEnvTask(self.name, "", "", seed=rng.randrange(2**31))

    async def start(self) -> str:
        """The server's URL, started on the first call (`run_group` calls it; a caller may call it early)."""
        async with self._starting:  # a step's groups start together: one of them starts the server
            if self._failed is not None:
                raise self._failed  # the groups that waited fail alike instead of starting it again
            if not self.server.url:
                _no_proxy_for_loopback()
                try:
                    await self.server.start()
                    await self._check_schema()
                except PluginError as exc:
                    self._failed = exc
                    raise
        return self.server.url

    async def _check_schema(self) -> None:
        """The action schema has `action_field` (a string field): refused with the fields it has otherwise."""
        import httpx

        async with httpx.AsyncClient(base_url=self.server.url, timeout=30.0, trust_env=False) as client:
            r = await client.get("/schema")
        r.raise_for_status()
        action = r.json().get("action", {})
        fields = action.get("properties", {})
        if self.tool_parser is not None and action.get("title") == "CallToolAction":
            return  # an MCP-only app: every reply must be a tool call, which the parser's contract says
        if fields.get(self.action_field, {}).get("type") != "string":
            valid = ", ".join(n for n, f in fields.items() if f.get("type") == "string") or "(none)"
            self.server.stop()
            raise PluginError(
                f"OpenEnv environment {self.name!r}: action_field = {self.action_field!r} is not a string field of "
                f"the app's action; its string fields: {valid}"
            )

    async def close(self) -> None:
        self.server.stop()

    def _text(self, observation: dict, sample_id: str) -> str:
        text = observation.get(self.observation_field)
        if not isinstance(text, str):
            fields = ", ".join(k for k, v in observation.items() if isinstance(v, str)) or "(none)"
            raise PluginError(
                f"OpenEnv environment {self.name!r}, episode {sample_id}: the observation has no string field "
                f"observation_field = {self.observation_field!r}; its string fields: {fields}"
            )
        return text

    async def run_group(
        self, group: GroupSampler, task: Task, run_id: str, step: int, group_idx: int
    ) -> list[RolloutRow]:
        """The group's `group_size` episodes of `task` (one seed), one scored row each."""
        assert isinstance(task, OpenEnvTask)
        url = await self.start()
        group_id = rollouts.group_id(step, group_idx)
        played = await asyncio.gather(
            *(
                self._episode(
                    group, task, url, group.request(step, group_idx, k), run_id, rollouts.sample_id(group_id, k)
                )
                for k in range(group.group_size)
            )
        )
        return [self._row(group, task, p, run_id, step, group_id, k) for k, p in enumerate(played)]

    async def _episode(
        self, group: GroupSampler, task: OpenEnvTask, url: str, request: RequestBuilder, run_id: str, sid: str
    ) -> _Played:
        """One WebSocket session: reset with the task's seed, then the turns."""
        async with self.sessions, _client(url, self.step_timeout_s) as env:
            result = await self._ask(env.reset(seed=task.seed, **self.reset_args), "reset", sid)
            first = self._text(result.observation, sid)
            played = _Played(Episode(prompt_ids=group.tok.render_prompt(first)), first, [], bool(result.done))
            if played.done:
                raise PluginError(f"OpenEnv environment {self.name!r}, episode {sid}: reset returned done = true")
            if len(played.episode.prompt_ids) >= group.max_seq_len:
                raise PluginError(
                    f"OpenEnv environment {self.name!r}, episode {sid}: the reset observation is "
                    f"{len(played.episode.prompt_ids)} tokens, model.max_seq_len = {group.max_seq_len} leaves no room"
                )
            await self._turns(group, env, request, played, f"{run_id}/{sid}", sid)
        played.episode.text = group.tok.decode(played.episode.completion_ids, skip_special=False)
        return played

    async def _turns(
        self, group: GroupSampler, env: Any, request: RequestBuilder, p: _Played, session_id: str, sid: str
    ) -> None:
        """Model turns and steps until the server says done, `max_turns`, a length stop, or no room."""
        e = p.episode
        for turn in range(self.max_turns):
            room = group.max_seq_len - len(e.context)
            choice = await group.sample(request(e.context, room, turn), session_id)
            if self.record:
                self._record(sid, turn, e.context, choice)
            e.add_turn(choice)
            call = self.tool_parser(choice.text) if self.tool_parser is not None else None
            result = await self._step(env, choice.text, call, sid)
            p.rewards.append(float(result.reward or 0.0))
            p.done = bool(result.done)
            if p.done or choice.finish_reason != "stop" or turn + 1 == self.max_turns:
                return
            message = (
                {"role": self.tool_role, "content": tool_text(result.observation)}
                if call is not None
                else {"role": self.role, "content": self._text(result.observation, sid)}
            )
            response = group.tok.render_continuation([message])
            if len(e.context) + len(response) >= group.max_seq_len:  # no room for a model token after it
                return
            e.add_environment(response)

    async def _step(self, env: Any, reply: str, call: tuple[str, dict] | None, sid: str) -> Any:
        """The reply as the text action, or as an MCP tool call; the server's refusal names the episode."""
        if call is None:
            action: dict = {self.action_field: reply}
        else:
            action = {"type": "call_tool", "tool_name": call[0], "arguments": call[1]}
        return await self._ask(env.step(action), f"step {action}", sid)

    async def _ask(self, request: Any, what: str, sid: str) -> Any:
        """An answer of the server; its error answers (openenv's client raises them as RuntimeError) and a
        dropped connection name the environment, the episode and the request."""
        try:
            return await request
        except (RuntimeError, ConnectionError) as exc:
            raise RuntimeError(f"OpenEnv environment {self.name!r}, episode {sid}: {what}: {exc}") from None

    def _record(self, sample_id: str, turn: int, prompt: list[int], choice: Any) -> None:
        """One line per model turn: the ids sent and the server's choice as received, for audits."""
        line = {"sample_id": sample_id, "turn": turn, "prompt": list(prompt), "choice": choice.model_dump(mode="json")}
        assert self.record is not None
        with open(self.record, "a") as f:  # noqa: ASYNC230 - a small append per turn, audit-only
            f.write(json.dumps(line) + "\n")

    def _row(self, group: GroupSampler, task: OpenEnvTask, p: _Played, run_id: str, step: int, gid: str, k: int):
        reward = sum(p.rewards) if self.reward_mode == "sum" else (p.rewards[-1] if p.rewards else 0.0)
        scores = {"metric/turns": float(len(p.rewards)), "metric/done": float(p.done)}
        return p.episode.row(
            replace(task, prompt=p.first),
            run_id,
            step,
            rollouts.sample_id(gid, k),
            gid,
            reward=float(reward),
            temperature=group.temperature,
            metric_names=list(scores),
            metric_values=list(scores.values()),
        )


CLOSE_WAIT_S = 5.0


def _client(url: str, step_timeout_s: float) -> Any:
    """openenv-core's `GenericEnvClient` for one session, ending it with a closing handshake: its own `disconnect`
    sends `close` and drops the connection at once, so the server's own close raises and logs an ASGI error
    traceback per session (tens of MB over a run); waiting for the server to close first avoids that."""
    from openenv.core import GenericEnvClient

    class Client(GenericEnvClient):
        async def disconnect(self) -> None:
            ws = self._ws
            if ws is not None:
                with contextlib.suppress(Exception):  # best effort, as openenv's own disconnect
                    await ws.send(json.dumps({"type": "close"}))
                    await asyncio.wait_for(ws.wait_closed(), CLOSE_WAIT_S)
            await super().disconnect()

    return Client(base_url=url, message_timeout_s=step_timeout_s)


def tool_text(observation: dict) -> str:
    """What the model sees of an MCP tool call's observation (openenv's `CallToolObservation`): the error, or the
    result's text contents, or its data as JSON."""
    error = observation.get("error")
    if error:
        return f"error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = observation.get("result")
    if not isinstance(result, dict):
        return "" if result is None else str(result)
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    return "".join(texts) if texts else json.dumps(result.get("data"))


def _no_proxy_for_loopback() -> None:
    """Loopback traffic must never reach a proxy: openenv's client and websockets read the proxy settings of the
    environment, and the client rewrites NO_PROXY around each connect, which concurrent episodes would race on."""
    current = os.environ.get("NO_PROXY", "")
    if "localhost" not in current.lower():
        os.environ["NO_PROXY"] = ",".join(x for x in (current, "localhost", "127.0.0.1") if x)


def _check_options(o: dict[str, Any]) -> None:
    for key in ("max_turns", "max_sessions"):
        if isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < 1:
            raise PluginError(f"{key} = {o[key]!r}; need an integer >= 1")
    for key in ("startup_timeout_s", "step_timeout_s"):
        if isinstance(o[key], bool) or not isinstance(o[key], int | float) or o[key] <= 0:
            raise PluginError(f"{key} = {o[key]!r}; need a number of seconds > 0")
    if o["reward"] not in REWARDS:
        raise PluginError(f"reward = {o['reward']!r}; valid: {', '.join(map(repr, REWARDS))}")
    if not isinstance(o["reset_args"], dict):
        raise PluginError(f"reset_args = {o['reset_args']!r}; need a table of reset keyword arguments")
    for key in ("action_field", "observation_field", "role", "tool_role"):
        if not isinstance(o[key], str) or not o[key]:
            raise PluginError(f"{key} = {o[key]!r}; need a non-empty string")


def _check_app(app: str) -> None:
    """openenv-core is installed and the app's module exists (found, not imported: the server imports it)."""
    if importlib.util.find_spec("openenv") is None:
        raise PluginError(f"the `openenv` environment needs openenv-core, which is not installed; {INSTALL}")
    module, sep, attr = app.partition(":")
    if not sep or not module or not attr:
        raise PluginError(f"app = {app!r}; need the import path of the OpenEnv ASGI app, `module:attribute`")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise PluginError(f"app = {app!r}: cannot look up module {module!r} ({exc})") from None
    if found is None:
        raise PluginError(f"app = {app!r}: no module {module!r}; install its package or put it on PYTHONPATH")


def _parser(path: str | None) -> Parser | None:
    if path is None:
        return None
    parser = import_object(path)
    if not callable(parser):
        raise PluginError(f"tool_parser = {path!r} is a {type(parser).__name__}, not a callable")
    return parser


def openenv(
    app: str,
    action_field: str = "message",
    observation_field: str = "prompt",
    role: str = "user",
    max_turns: int = 8,
    reset_args: dict | None = None,
    reward: str = "sum",
    max_sessions: int = 1,
    startup_timeout_s: float = 120.0,
    step_timeout_s: float = 60.0,
    log_dir: str | None = None,
    record: str | None = None,
    tool_parser: str | None = None,
    tool_role: str = "tool",
) -> OpenEnvEnvironment:
    """The `openenv` plugin: serve the OpenEnv ASGI app `app` (`module:attribute`) locally and play its episodes
    (docs/environments.md, "OpenEnv"; each argument is described there)."""
    _check_app(app)
    options = {
        "action_field": action_field,
        "observation_field": observation_field,
        "role": role,
        "max_turns": max_turns,
        "reset_args": reset_args if reset_args is not None else {},
        "reward": reward,
        "max_sessions": max_sessions,
        "startup_timeout_s": startup_timeout_s,
        "step_timeout_s": step_timeout_s,
        "log_dir": log_dir,
        "record": record,
        "tool_parser": _parser(tool_parser),
        "tool_role": tool_role,
    }
    _check_options(options)
    return OpenEnvEnvironment(f"openenv:{app.partition(':')[0]}", app, options)
