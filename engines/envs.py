"""Environments: seeded task generators with a reward, plus the weighted mix a run draws from.

To add one, implement `Environment` (`sample(rng) -> Task`, `reward(task, completion)`) and register its
import path in config/registry.py's ENVIRONMENTS; its name then becomes valid in `[[envs]]`
(docs/environments.md).
Prompts are `<tag>:<payload>=` and the model answers after `=`, ending with `<eos>`.
"""

from __future__ import annotations

import difflib
import importlib
import random
import string
from dataclasses import dataclass
from typing import Protocol

from config.envs import EnvSpec
from config.registry import ENVIRONMENTS


@dataclass(frozen=True)
class Task:
    env: str
    prompt: str  # text after <bos>, ends with '='
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

    def _length(self, rng: random.Random) -> int:
        if self.lengths == "long-tail":
            return min(self.max_chars, self.min_chars - 1 + int(rng.paretovariate(LONG_TAIL_ALPHA)))
        return rng.randint(self.min_chars, self.max_chars)

    def _payload(self, rng: random.Random) -> str:
        n = self._length(rng)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    def sample(self, rng: random.Random) -> Task:
        payload = self._payload(rng)
        return Task(self.name, f"{self.tag}:{payload}=", self.solve(payload))

    tag = ""  # the prompt's task marker, `<tag>:<payload>=`

    def solve(self, payload: str) -> str:
        raise NotImplementedError

    def reward(self, task: Task, completion: str) -> float:
        return similarity(completion, task.answer)


class ReverseText(_StringTask):
    tag = "rev"

    def solve(self, payload: str) -> str:
        return payload[::-1]


class SortLetters(_StringTask):
    tag = "sort"

    def solve(self, payload: str) -> str:
        return "".join(sorted(payload))


def build(spec: EnvSpec) -> Environment:
    module, _, attr = ENVIRONMENTS[spec.name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(spec.name, spec.min_chars, spec.max_chars, spec.lengths)


class EnvMix:
    """Weighted choice among environments; `task(key)` is a pure function of (seed, key)."""

    def __init__(self, specs: list[EnvSpec], seed: int):
        self.envs: dict[str, Environment] = {s.name: build(s) for s in specs}
        self.names = [s.name for s in specs]
        self.weights = [s.weight for s in specs]
        self.seed = seed

    def task(self, key: str) -> Task:
        rng = random.Random(f"{self.seed}/{key}")
        name = rng.choices(self.names, weights=self.weights)[0]
        return self.envs[name].sample(rng)

    def reward(self, task: Task, completion: str) -> float:
        return self.envs[task.env].reward(task, completion)
