"""Environments: seeded task generators with a reward, plus the weighted mix a run draws from.

An environment is any object with `sample(rng) -> Task` and `reward(task, completion) -> float`, made
by a factory that an `[[envs]]` entry names by import path or entry point (engines/environments/plugins.py,
docs/environments.md). The two built-in toy tasks below are such plugins (`reverse_text`,
`sort_letters`, registered as entry points in pyproject.toml).
A task's `prompt` is the user message; the tokenizer renders it through its chat template
(`Tokenizer.render_prompt`). In the `tag` style (the built-in model) the message is `<tag>:<payload>`
and the character tokenizer's template makes it `<bos><tag>:<payload>=`; the `instruct` style (chat
models) asks in a sentence. The model's answer ends with its tokenizer's end-of-sequence token.

Tasks may carry images (`Task.images`; the toy visual task is `count-shapes`, engines/environments/shapes.py).

Held-out split: an environment that can be evaluated also has `eval_size` and `eval_task(index)`, a fixed,
seeded list of tasks that its `sample` never draws (`HeldOut`; `rollflow eval`, docs/evaluation.md). The string
tasks split their payloads by a hash (one in EVAL_BUCKETS is held out); reasoning-gym holds out its first items.
"""

from __future__ import annotations

import difflib
import random
import string
import zlib
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from config.envs import EnvSpec
from engines.environments import plugins


@dataclass(frozen=True)
class Task:
    env: str
    prompt: str  # the user message (rendered by the tokenizer's chat template)
    answer: str  # the reference completion (without <eos>)
    # PNG or JPEG bytes, shown before the prompt text in the user message (engines/models/vision.py): the
    # orchestrator renders [{"type": "image"}] * len(images) + [{"type": "text", "text": prompt}]. Empty: text only.
    # Keyword-only: subclasses' own fields (plugins') keep their positions after `answer`.
    images: tuple[bytes, ...] = field(default=(), kw_only=True)


class EnvironmentRefused(RuntimeError):
    """A task this run's settings can never play (its first prompt leaves no room in model.max_seq_len): the
    orchestrator exits with EXIT_REFUSED and the `rl` flow stops the run instead of restarting it, since
    every restart would draw the same task and fail the same way. The message names the setting and the fix."""


class Environment(Protocol):
    def sample(self, rng: random.Random) -> Task: ...

    def reward(self, task: Task, completion: str) -> float: ...


class HeldOut(Protocol):
    """An environment with a held-out split: `eval_task(i)` for i < `eval_size`, none of which `sample` draws."""

    eval_size: int

    def eval_task(self, index: int) -> Task: ...


def has_held_out(env: object) -> bool:
    return callable(getattr(env, "eval_task", None)) and isinstance(getattr(env, "eval_size", None), int)


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


# Pareto shape of long-tail payload lengths: P(extra chars >= k) ~ (k + 1) ** -1.2, so a step of a few
# hundred samples almost always holds a max-length one. That straggler sets a static batch's decode time.
LONG_TAIL_ALPHA = 1.2
# One payload in EVAL_BUCKETS (by CRC-32) belongs to the held-out split; training redraws it.
EVAL_BUCKETS = 10
# Draws before giving up on finding a payload of the wanted split (a split holds ~1/EVAL_BUCKETS of them).
MAX_DRAWS = 1000


@dataclass
class _StringTask:
    name: str
    min_chars: int
    max_chars: int
    lengths: str = "uniform"
    style: str = "tag"  # "tag" or "instruct"
    eval_size: int = 200

    def _length(self, rng: random.Random) -> int:
        if self.lengths == "long-tail":
            return min(self.max_chars, self.min_chars - 1 + int(rng.paretovariate(LONG_TAIL_ALPHA)))
        return rng.randint(self.min_chars, self.max_chars)

    def _payload(self, rng: random.Random) -> str:
        n = self._length(rng)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    def _split_payload(self, rng: random.Random, held_out: bool) -> str:
        for _ in range(MAX_DRAWS):
            payload = self._payload(rng)
            if (zlib.crc32(payload.encode()) % EVAL_BUCKETS == 0) == held_out:
                return payload
        split = "held-out" if held_out else "training"
        raise ValueError(f"{self.name}: no {split} payload in {MAX_DRAWS} draws; widen min_chars..max_chars")

    def sample(self, rng: random.Random) -> Task:
        return self._task(self._split_payload(rng, held_out=False))

    def eval_task(self, index: int) -> Task:
        return self._task(self._split_payload(random.Random(f"{self.name}/eval/{index}"), held_out=True))

    def _task(self, payload: str) -> Task:
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


Lengths = Literal["uniform", "long-tail"]


def _string_task(
    cls: type[_StringTask], name: str, min_chars: int, max_chars: int, lengths: str, prompt_style: str, eval_size: int
) -> _StringTask:
    if not (isinstance(min_chars, int) and isinstance(max_chars, int) and 0 < min_chars <= max_chars):
        raise ValueError(f"need integers 0 < min_chars <= max_chars, got min_chars={min_chars} max_chars={max_chars}")
    if lengths not in ("uniform", "long-tail"):
        raise ValueError(f"lengths={lengths!r}; valid: 'uniform', 'long-tail'")
    if not (isinstance(eval_size, int) and eval_size > 0):
        raise ValueError(f"eval_size={eval_size!r}; need a positive integer (the held-out tasks)")
    return cls(name, min_chars, max_chars, lengths, prompt_style, eval_size)


def reverse_text(
    min_chars: int = 3,
    max_chars: int = 8,
    lengths: Lengths = "uniform",
    prompt_style: str = "tag",
    eval_size: int = 200,
) -> Environment:
    """The `reverse-text` plugin: reverse `min_chars`..`max_chars` random lowercase letters; `eval_size` held-out
    tasks (payloads of the hash bucket training never draws)."""
    return _string_task(ReverseText, "reverse-text", min_chars, max_chars, lengths, prompt_style, eval_size)


def sort_letters(
    min_chars: int = 3,
    max_chars: int = 8,
    lengths: Lengths = "uniform",
    prompt_style: str = "tag",
    eval_size: int = 200,
) -> Environment:
    """The `sort-letters` plugin: sort `min_chars`..`max_chars` random lowercase letters; `eval_size` held-out
    tasks (payloads of the hash bucket training never draws)."""
    return _string_task(SortLetters, "sort-letters", min_chars, max_chars, lengths, prompt_style, eval_size)


def build(spec: EnvSpec, default_style: str = "tag") -> Environment:
    """`default_style` applies where the spec says `prompt = "auto"` (the tokenizer's `prompt_style`)."""
    return plugins.build(spec, default_style)


class EnvMix:
    """Weighted choice among environments; `task(key)` is a pure function of (seed, key).

    Tasks carry their entry's `name` as `env` (whatever the plugin put there), which routes the reward
    back to the environment that drew them and labels the lake's rows.
    """

    def __init__(self, specs: list[EnvSpec], seed: int, default_style: str = "tag"):
        self.envs: dict[str, Environment] = {s.label: build(s, default_style) for s in specs}
        self.names = [s.label for s in specs]
        self.weights = [s.weight for s in specs]
        self.seed = seed

    def task(self, key: str) -> Task:
        rng = random.Random(f"{self.seed}/{key}")
        name = rng.choices(self.names, weights=self.weights)[0]
        task = self.envs[name].sample(rng)
        return task if task.env == name else replace(task, env=name)

    def reward(self, task: Task, completion: str) -> float:
        return float(self.envs[task.env].reward(task, completion))
