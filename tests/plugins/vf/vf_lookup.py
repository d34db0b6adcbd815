"""Multi-turn tool-calling verifiers environment: call `lookup` with the prompt's key, then answer with the
value the tool returned. Rewards: half for calling the tool with the right key, half for the answer's
similarity to the value; metric: the number of tool calls."""

from __future__ import annotations

import json
import random
import string
from difflib import SequenceMatcher

import verifiers.v1 as vf
from verifiers.v1.interception.server import InterceptionServerConfig
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from vf_chat_loop import ChatLoopHarness
from vf_tools import value

__all__ = ["LookupTaskset", "ChatLoopHarness", "load_environment"]


class LookupData(vf.TaskData):
    key: str = ""
    salt: int = 0
    tools: list[str] = ["lookup"]


def _calls(trace) -> list[dict]:
    return [
        json.loads(c.arguments or "{}") for m in trace.messages if m.role == "assistant" for c in (m.tool_calls or [])
    ]


class LookupTask(vf.Task[LookupData]):
    @vf.reward(weight=0.5)
    async def called_key(self, task: LookupData, trace) -> float:
        calls = _calls(trace)
        return SequenceMatcher(None, str(calls[0].get("key", "")), task.key).ratio() if calls else 0.0

    @vf.reward(weight=0.5)
    async def answer(self, task: LookupData, trace) -> float:
        replies = [m.content for m in trace.messages if m.role == "assistant" and not m.tool_calls]
        reply = (replies[-1] or "").strip() if replies else ""
        return SequenceMatcher(None, reply, value(task.salt, task.key)).ratio()

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(len(_calls(trace)))


class LookupTasksetConfig(vf.TasksetConfig):
    id: str = "vf_lookup"
    num_tasks: int = 64


class LookupTaskset(vf.Taskset[LookupTask, LookupTasksetConfig]):
    def load(self):
        rng = random.Random(1)
        for _ in range(self.config.num_tasks):
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 3)))
            yield LookupTask(LookupData(prompt=f"get:{key}", key=key, salt=rng.getrandbits(32)))


def load_environment(num_tasks: int = 64, stream: bool = False) -> vf.Env:
    """`stream`: the harness asks for every model turn streamed (as verifiers' shipped harnesses do)."""
    harness = {"id": "vf_lookup", "stream": stream}  # this module's harness (ChatLoopHarness), configured
    config = vf.SingleAgentEnvConfig(
        taskset=LookupTasksetConfig(num_tasks=num_tasks),
        agent=vf.AgentConfig(runtime=SubprocessConfig(), harness=harness),  # in-process loop: no sandbox
        interception=InterceptionServerConfig(),
    )
    return vf.SingleAgentEnv(config)
