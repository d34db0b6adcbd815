"""An OpenEnv environment with MCP tools, written against openenv-core's public API (`MCPEnvironment` with FastMCP
tools), offline, for rollflow's tests: look a key up with the `lookup` tool, then `submit` its value.

`reset(seed)` shows `get:KEY` (2-3 letters); `lookup(key)` answers `is:VALUE`, the value stored under the key it
was given (a pure function of the episode's salt and that key); `submit(answer)` ends the episode with reward
0.5 x similarity(first key looked up, KEY) + 0.5 x similarity(answer, VALUE) (difflib ratios), as rollflow's own
tool-lookup task scores. Every action is an MCP tool call (the app's action class is `CallToolAction`);
`parse_call` is the reply parser rollflow's `tool_parser` names: `?KEY` looks KEY up, another reply whose first
character sorts before `n` (digits, punctuation, a-m) looks the whole reply up, and any other reply (or an empty
one) submits. The second rule is for the tests' untrained model, which rarely writes `?` first: it makes both
tools come up in a few episodes.
"""

from __future__ import annotations

import random
import string
from difflib import SequenceMatcher
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import CallToolAction, CallToolObservation, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment

CALL = "?"


def parse_call(reply: str) -> tuple[str, dict]:
    if reply.startswith(CALL):
        return "lookup", {"key": reply[len(CALL) :]}
    if reply and reply[0] < "n":
        return "lookup", {"key": reply}
    return "submit", {"answer": reply}


def value(salt: int, key: str) -> str:
    rng = random.Random(f"{salt}/{key}")
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 3)))


class LookupObservation(Observation):
    prompt: str = ""


class LookupGame(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance and tools

    def __init__(self) -> None:
        mcp = FastMCP("oe_lookup")

        @mcp.tool
        def lookup(key: str) -> str:
            """The value stored under `key`."""
            self.called.append(key)
            return f"is:{value(self.salt, key)}"

        @mcp.tool
        def submit(answer: str) -> str:
            """Submit the answer; ends the episode."""
            return "ok"

        super().__init__(mcp)
        self._state, self.key, self.salt, self.called = State(), "", 0, []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> LookupObservation:
        rng = random.Random(seed)
        self.key = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 3)))
        self.salt, self.called, self._state = rng.getrandbits(32), [], State(episode_id=episode_id)
        return LookupObservation(prompt=f"get:{self.key}")

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            called = SequenceMatcher(None, self.called[0], self.key).ratio() if self.called else 0.0
            answer = SequenceMatcher(None, action.arguments.get("answer", ""), value(self.salt, self.key)).ratio()
            observation.reward, observation.done = 0.5 * called + 0.5 * answer, True
        return observation

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"oe_lookup takes MCP tool calls only, got {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


app = create_app(LookupGame, CallToolAction, CallToolObservation, env_name="oe_lookup", max_concurrent_envs=64)
