"""Multi-turn toy tool task the built-in model can learn: look a key up, then answer with its value.

Episode (tag style, the character tokenizer; `=` opens each model turn):
    user  `get:qkm`       the task: the value stored under key `qkm`
    model `?qkm`          a tool call: `?` followed by the key to look up
    tool  `is:hbdwa`      the tool's answer: the value stored under the key the model asked for
    model `hbdwa`         the answer
The values are drawn per task, so the answer cannot be known without calling the tool with the right
key. Reward: half the similarity of the called key to the task's key, half the similarity of the final
answer to the task's value (a wrong key returns another key's value; no call ends the episode with that
reply as the answer and no credit for a call). The call's half makes the reward dense: an exact-match-only
reward does not move a model this small. In the instruct style (chat models) the same
exchange is worded as sentences.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from engines.environments.base import Task, similarity

CALL = "?"
TOOL_PREFIX = "is:"


@dataclass(frozen=True)
class LookupTask(Task):
    key: str = ""
    salt: int = 0  # the task's table of values: value(key) is a pure function of (salt, key)


class ToolLookup:
    """`[[envs]] id = "tool-lookup"`: keys of min_chars..max_chars letters, values of the same lengths."""

    max_turns = 2

    def __init__(self, name: str, min_chars: int, max_chars: int, style: str = "tag"):
        self.name, self.min_chars, self.max_chars, self.style = name, min_chars, max_chars, style

    def _word(self, rng: random.Random) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_chars, self.max_chars)))

    def value(self, salt: int, key: str) -> str:
        return self._word(random.Random(f"{salt}/{key}"))

    def sample(self, rng: random.Random) -> Task:
        key, salt = self._word(rng), rng.getrandbits(32)
        if self.style == "instruct":
            prompt = f"Call the lookup tool by replying {CALL}KEY for the key {key}, then reply with its value only."
        else:
            prompt = f"get:{key}"
        return LookupTask(self.name, prompt, self.value(salt, key), key=key, salt=salt)

    def _called_key(self, reply: str) -> str | None:
        reply = reply.strip()
        return reply[len(CALL) :] if reply.startswith(CALL) else None

    def respond(self, task: Task, replies: list[str]) -> list[dict] | None:
        assert isinstance(task, LookupTask)
        key = self._called_key(replies[-1]) if len(replies) == 1 else None
        if key is None:
            return None
        value = self.value(task.salt, key)
        content = f"The value is {value}." if self.style == "instruct" else f"{TOOL_PREFIX}{value}"
        return [{"role": "tool" if self.style == "instruct" else "user", "content": content}]

    def score(self, task: Task, replies: list[str]) -> float:
        assert isinstance(task, LookupTask)
        key = self._called_key(replies[0]) if len(replies) > 1 else None
        answer = replies[-1].strip() if self.style == "instruct" else replies[-1]
        return 0.5 * (similarity(key, task.key) if key is not None else 0.0) + 0.5 * similarity(answer, task.answer)

    def demonstration(self, task: Task) -> list[str]:
        assert isinstance(task, LookupTask)
        return [f"{CALL}{task.key}", task.answer]

    def reward(self, task: Task, completion: str) -> float:
        """Single-turn scoring of a whole completion: as if it were the last reply."""
        return self.score(task, [completion])


def tool_lookup(min_chars: int = 3, max_chars: int = 8, prompt_style: str = "tag") -> ToolLookup:
    """The `tool-lookup` plugin: look a key of `min_chars`..`max_chars` letters up with the tool, then answer."""
    if not (isinstance(min_chars, int) and isinstance(max_chars, int) and 0 < min_chars <= max_chars):
        raise ValueError(f"need integers 0 < min_chars <= max_chars, got min_chars={min_chars} max_chars={max_chars}")
    return ToolLookup("tool-lookup", min_chars, max_chars, prompt_style)
