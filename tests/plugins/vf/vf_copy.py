"""Single-turn verifiers environment: reply with the prompt's letters. Reward: character similarity of the
reply to the word; metric: the reply's length."""

from __future__ import annotations

import random
import string
from difflib import SequenceMatcher

import verifiers.v1 as vf
from verifiers.v1.interception.server import InterceptionServerConfig
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from vf_chat_loop import ChatLoopHarness

__all__ = ["CopyTaskset", "ChatLoopHarness", "load_environment"]


class CopyData(vf.TaskData):
    word: str = ""


class CopyTask(vf.Task[CopyData]):
    @vf.reward
    async def similarity(self, task: CopyData, trace) -> float:
        return SequenceMatcher(None, _reply(trace), task.word).ratio()

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(_reply(trace)))


def _reply(trace) -> str:
    replies = [m.content for m in trace.messages if m.role == "assistant" and isinstance(m.content, str)]
    return replies[-1].strip() if replies else ""


class CopyTasksetConfig(vf.TasksetConfig):
    id: str = "vf_copy"
    num_tasks: int = 64


class CopyTaskset(vf.Taskset[CopyTask, CopyTasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(self.config.num_tasks):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 4)))
            yield CopyTask(CopyData(prompt=word, word=word))


def load_environment(num_tasks: int = 64) -> vf.Env:
    config = vf.SingleAgentEnvConfig(
        taskset=CopyTasksetConfig(num_tasks=num_tasks),
        agent=vf.AgentConfig(runtime=SubprocessConfig()),  # the loop runs in-process: no sandbox to start
        interception=InterceptionServerConfig(),
    )
    return vf.SingleAgentEnv(config)
