"""Environments: seeded task generators with a reward, plus the weighted mix a run draws from.

To add one, implement `Environment` (`sample(rng) -> Task`, `reward(task, completion)`) and register its
import path in config/registry.py's ENVIRONMENTS; its name then becomes valid in `[[envs]]`
(docs/environments.md).
A task's `prompt` is the user message; the tokenizer renders it through its chat template
(`Tokenizer.render_prompt`). In the `tag` style (the built-in model) the message is `<tag>:<payload>`
and the character tokenizer's template makes it `<bos><tag>:<payload>=`; the `instruct` style (chat
models) asks in a sentence. The model's answer ends with its tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import difflib
import random
import string
from dataclasses import dataclass
from typing import Protocol

from config.envs import EnvSpec
from config.registry import ENVIRONMENTS
from engines import registry


@dataclass(frozen=True)
class Task:
    env: str
    prompt: str  # the user message (rendered by the tokenizer's chat template)
    answer: str  # the reference completion (without <eos>)


class Environment(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Task: ...

    def reward(self, task: Task, completion: str) -> float: ...


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


# Pareto shape of long-tail payload lengths: P(extra chars >= k) ~ (k + 1) ** -1.2, so a step of a few
# hundred samples almost always holds a max-length one. That straggler sets a static batch's decode time.
LONG_TAIL_ALPHA = 1.2


@dataclass
class _StringTask:
    name: str
    min_chars: int
    max_chars: int
    lengths: str = "uniform"
    style: str = "tag"  # "tag" or "instruct"

    def _length(self, rng: random.Random) -> int:
        if self.lengths == "long-tail":
            return min(self.max_chars, self.min_chars - 1 + int(rng.paretovariate(LONG_TAIL_ALPHA)))
        return rng.randint(self.min_chars, self.max_chars)

    def _payload(self, rng: random.Random) -> str:
        n = self._length(rng)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    def sample(self, rng: random.Random) -> Task:
        payload = self._payload(rng)
        prompt = self.instruction.format(payload=payload) if self.style == "instruct" else f"{self.tag}:{payload}"
        return Task(self.name, prompt, self.solve(payload))

    tag = ""  # the tag-style message's task marker, `<tag>:<payload>`
    instruction = "{payload}"  # the instruct-style message

    def solve(self, payload: str) -> str:
        raise NotImplementedError

    def reward(self, task: Task, completion: str) -> float:
        # chat models wrap answers in whitespace that says nothing about the answer
        return similarity(completion.strip() if self.style == "instruct" else completion, task.answer)


class ReverseText(_StringTask):
    tag = "rev"
    instruction = "Reverse the text {payload}\nReply with the reversed text only."

    def solve(self, payload: str) -> str:
        return payload[::-1]


class SortLetters(_StringTask):
    tag = "sort"
    instruction = "Sort the letters of {payload} alphabetically.\nReply with them only."

    def solve(self, payload: str) -> str:
        return "".join(sorted(payload))


def build(spec: EnvSpec, default_style: str = "tag") -> Environment:
    """`default_style` applies where the spec says `prompt = "auto"` (the tokenizer's `prompt_style`)."""
    cls = registry.load(ENVIRONMENTS[spec.name])
    style = default_style if spec.prompt == "auto" else spec.prompt
    return cls(spec.name, spec.min_chars, spec.max_chars, spec.lengths, style)


class EnvMix:
    """Weighted choice among environments; `task(key)` is a pure function of (seed, key)."""

    def __init__(self, specs: list[EnvSpec], seed: int, default_style: str = "tag"):
        self.envs: dict[str, Environment] = {s.name: build(s, default_style) for s in specs}
        self.names = [s.name for s in specs]
        self.weights = [s.weight for s in specs]
        self.seed = seed

    def task(self, key: str) -> Task:
        rng = random.Random(f"{self.seed}/{key}")
        name = rng.choices(self.names, weights=self.weights)[0]
        return self.envs[name].sample(rng)

    def reward(self, task: Task, completion: str) -> float:
        return self.envs[task.env].reward(task, completion)
