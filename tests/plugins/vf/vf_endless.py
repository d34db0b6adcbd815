"""An infinite verifiers taskset (`INFINITE = True`, `load()` never ends), as verifiers' TextArena games are: each
task is a seeded "board" of `board_chars` letters with a system prompt, the model must repeat the board's first
word. `BUILT` counts the tasks `load()` has made in this process, so a test can see how far loading read.

`load_environment(sandboxed=True)` leaves verifiers' defaults (the `prime` runtime, the elastic interception
pool), as an env written for hosted sandboxes does; the default runs the in-process chat loop locally.
"""

from __future__ import annotations

import itertools
import random
import string

import verifiers.v1 as vf
from verifiers.v1.interception.server import InterceptionServerConfig
from verifiers.v1.runtimes.subprocess import SubprocessConfig
from vf_chat_loop import ChatLoopHarness

__all__ = ["BUILT", "ChatLoopHarness", "EndlessTaskset", "load_environment"]

BUILT = [0]  # tasks made by load() so far, in this process


class EndlessData(vf.TaskData):
    word: str = ""


class EndlessTask(vf.Task[EndlessData]):
    @vf.reward
    async def first_word(self, task: EndlessData, trace) -> float:
        replies = [m.content for m in trace.messages if m.role == "assistant" and isinstance(m.content, str)]
        return float(bool(replies) and replies[-1].strip() == task.word)


class EndlessTasksetConfig(vf.TasksetConfig):
    id: str = "vf_endless"
    board_chars: int = 12


class EndlessTaskset(vf.Taskset[EndlessTask, EndlessTasksetConfig]):
    INFINITE = True

    def load(self):
        for seed in itertools.count():
            rng = random.Random(seed)
            board = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(self.config.board_chars))
            word = (board.split() or ["a"])[0]
            BUILT[0] += 1
            yield EndlessTask(EndlessData(prompt=board, system_prompt="repeat the first word", word=word))


def load_environment(board_chars: int = 12, sandboxed: bool = False) -> vf.Env:
    taskset = EndlessTasksetConfig(board_chars=board_chars)
    if sandboxed:  # verifiers' defaults: AgentConfig() runs in prime's sandboxes, behind the elastic pool
        return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset))
    config = vf.SingleAgentEnvConfig(
        taskset=taskset,
        agent=vf.AgentConfig(runtime=SubprocessConfig()),
        interception=InterceptionServerConfig(),
    )
    return vf.SingleAgentEnv(config)
