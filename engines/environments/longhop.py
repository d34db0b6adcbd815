"""Long-horizon toy tool task for the built-in char model: follow a chain of keys through a tool, 20+ turns.

Episode (tag style, the character tokenizer; `=` opens each model turn):
    user  `hop:qk`     the first key
    model `?qk`        a tool call: `?` followed by the key to look up
    tool  `:bw`        the tool's answer: the next key, stored under the key the model asked for
    model `?bw`        the next call ... for `turns` model turns, every one a tool call
Each answer is drawn per task from the called key (a wrong call gets another key's answer and the chain goes
on from there), so every turn depends on the tool's latest message. Reward: the mean over `turns` of the
similarity of each call to the key the latest message offered (0 for a reply that is not a call, and for turns
the episode did not reach): dense, so a model this small moves. Rendered, a turn is 8 tokens (`?qk<eos>:bw=`),
so 20 turns fit `model.max_seq_len = 192`. An episode of this length runs across weight updates: the
orchestrator records each turn's policy versions (docs/environments.md, "Long-horizon episodes and the
staleness rule").
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from engines.environments.base import Task, similarity

CALL = "?"
ANSWER = ":"


@dataclass(frozen=True)
class HopTask(Task):
    salt: int = 0  # the task's table: next(key) is a pure function of (salt, key)


class LongHop:
    """`[[envs]] id = "long-hop"`: `turns` tool calls on keys of min_chars..max_chars letters."""

    def __init__(self, name: str, turns: int, min_chars: int, max_chars: int, alphabet: str = string.ascii_lowercase):
        self.name, self.max_turns, self.min_chars, self.max_chars = name, turns, min_chars, max_chars
        self.alphabet = alphabet

    def _word(self, rng: random.Random) -> str:
        return "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_chars, self.max_chars)))

    def next_key(self, salt: int, key: str) -> str:
        return self._word(random.Random(f"{salt}/{key}"))

    def sample(self, rng: random.Random) -> Task:
        key, salt = self._word(rng), rng.getrandbits(32)
        return HopTask(self.name, f"hop:{key}", self.next_key(salt, key), salt=salt)

    @staticmethod
    def called(reply: str) -> str | None:
        return reply[len(CALL) :] if reply.startswith(CALL) else None

    def respond(self, task: Task, replies: list[str]) -> list[dict] | None:
        assert isinstance(task, HopTask)
        if len(replies) >= self.max_turns:
            return None
        key = self.called(replies[-1])
        # a reply that is no call gets the answer to its text, so the episode keeps its length
        return [{"role": "user", "content": ANSWER + self.next_key(task.salt, key if key is not None else replies[-1])}]

    def expected(self, task: Task, replies: list[str]) -> list[str]:
        """The key each turn should call: the first key, then the tool's answer to the previous call."""
        assert isinstance(task, HopTask)
        keys = [task.prompt.removeprefix("hop:")]
        for reply in replies[:-1]:
            key = self.called(reply)
            keys.append(self.next_key(task.salt, key if key is not None else reply))
        return keys

    def score(self, task: Task, replies: list[str]) -> float:
        replies = replies[: self.max_turns]
        calls = [self.called(r) for r in replies]
        pairs = zip(calls, self.expected(task, replies), strict=True)
        hits = [similarity(c, e) if c is not None else 0.0 for c, e in pairs]
        return sum(hits) / self.max_turns

    def demonstration(self, task: Task) -> list[str]:
        assert isinstance(task, HopTask)
        replies: list[str] = []
        for _ in range(self.max_turns):
            replies.append(CALL + self.expected(task, [*replies, ""])[-1])
        return replies

    def reward(self, task: Task, completion: str) -> float:
        """Single-turn scoring of a whole completion: as if it were the only reply."""
        return self.score(task, [completion])


def long_hop(
    turns: int = 20, min_chars: int = 2, max_chars: int = 2, alphabet: str = string.ascii_lowercase
) -> LongHop:
    """The `long-hop` plugin: `turns` chained tool calls on keys of `min_chars`..`max_chars` letters of
    `alphabet` (lowercase letters, which the character tokenizer has)."""
    if not (isinstance(turns, int) and turns >= 1):
        raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
    if not (isinstance(min_chars, int) and isinstance(max_chars, int) and 0 < min_chars <= max_chars):
        raise ValueError(f"need integers 0 < min_chars <= max_chars, got min_chars={min_chars} max_chars={max_chars}")
    if not (isinstance(alphabet, str) and alphabet and set(alphabet) <= set(string.ascii_lowercase)):
        raise ValueError(f"alphabet must be a non-empty string of lowercase letters, got {alphabet!r}")
    return LongHop("long-hop", turns, min_chars, max_chars, alphabet)
