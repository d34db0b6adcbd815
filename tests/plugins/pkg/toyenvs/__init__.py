"""A user's environment package, outside rollflow: good and bad environment factories.

It imports nothing from rollflow: a plugin's tasks only need `env`, `prompt` and `answer` attributes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EchoTask:
    env: str
    prompt: str
    answer: str


class Echo:
    """Repeat a word `times` times: `echo:ab` -> `abab` when times = 2."""

    def __init__(self, words: list[str], times: int, style: str):
        self.words, self.times, self.style = words, times, style

    def sample(self, rng: random.Random) -> EchoTask:
        word = rng.choice(self.words)
        prompt = f"echo:{word}" if self.style == "tag" else f"Repeat {word} {self.times} times."
        return EchoTask("toy-echo", prompt, word * self.times)

    def reward(self, task: EchoTask, completion: str) -> float:
        return 1.0 if completion.strip() == task.answer else 0.0


def echo(words: list[str] | None = None, times: int = 2, prompt_style: str = "tag") -> Echo:
    """Registered as the entry point `toy-echo`; takes the run's prompt style."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    return Echo(words or ["ab", "cd", "efg"], times, prompt_style)


class Factories:
    @staticmethod
    def upper(word: str = "abc") -> Echo:
        """Named by a dotted import path, `toyenvs:Factories.upper`; takes no prompt style."""
        return Echo([word.upper()], 1, "instruct")


def returns_wrong_type(size: int = 3) -> list[int]:
    return list(range(size))


def raises_on_args(level: str = "easy") -> Echo:
    raise RuntimeError(f"no such level {level!r}: easy, hard")


class BadSample:
    def sample(self, rng: random.Random) -> str:
        return "not a task"

    def reward(self, task: object, completion: str) -> float:
        return 0.0


def bad_sample() -> BadSample:
    return BadSample()


NOT_CALLABLE = 42
