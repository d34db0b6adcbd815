"""reasoning-gym datasets as an environment plugin (`[[envs]] id = "reasoning-gym"`).

`args = {dataset = "spell_backward", config = {min_word_len = 3}}` -> `reasoning_gym.create_dataset`
with that config, once, offline (the datasets are procedural; their word lists ship in the package).
Items `0..eval_size-1` are the held-out split (`eval_task(i)` is item i); `sample(rng)` picks an index of the
others from `rng` (so a task is a pure function of the run seed and its key, like
the toy tasks) and the dataset generates the item for it; the question is the user message, which the
orchestrator renders through the model's chat template. `reward` is the dataset's own `score_answer` on
the completion (or on its `<answer>...</answer>` part when it has one). reasoning-gym is imported only
when such an environment is built.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from engines.environments.base import Task

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXTRACTIONS = ("tag", "last_number")


@dataclass(frozen=True)
class IndexedTask(Task):
    index: int = 0  # the dataset item: reward regenerates it instead of carrying its metadata around


def extract_answer(completion: str, how: str = "tag") -> str:
    """`tag`: the `<answer>` part when the model wrote one (reasoning-gym's own prompt format), else the text;
    `last_number`: the last number in the text (as GSM8K-style graders read "The answer is 7."), else the text."""
    found = ANSWER_TAG.findall(completion) if how == "tag" else NUMBER.findall(completion)
    return (found[-1] if found else completion).strip()


class ReasoningGymEnv:
    def __init__(self, name: str, dataset: Any, instruction: str, eval_size: int, answer: str = "tag"):
        self.name, self.dataset, self.instruction, self.eval_size = name, dataset, instruction, eval_size
        self.answer = answer

    def sample(self, rng: random.Random) -> Task:
        return self._task(rng.randrange(self.eval_size, len(self.dataset)))

    def eval_task(self, index: int) -> Task:
        if not 0 <= index < self.eval_size:
            raise IndexError(f"{self.name}: held-out task {index} out of range 0..{self.eval_size - 1}")
        return self._task(index)

    def _task(self, index: int) -> Task:
        item = self.dataset[index]
        prompt = f"{item['question']}\n{self.instruction}" if self.instruction else item["question"]
        return IndexedTask(self.name, prompt, str(item["answer"]), index)

    def reward(self, task: Task, completion: str) -> float:
        if not isinstance(task, IndexedTask):
            raise TypeError(f"a reasoning-gym reward needs the task its sample() drew, got {type(task).__name__}")
        answer = extract_answer(completion, self.answer)
        return float(self.dataset.score_answer(answer, self.dataset[task.index]))


def load(
    dataset: str,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    size: int = 100_000,
    instruction: str = "Reply with the answer only.",
    eval_size: int = 200,
    answer: str = "tag",
) -> ReasoningGymEnv:
    """The `reasoning-gym` plugin. `dataset`: a reasoning-gym dataset name; `config`: its config's fields
    (not `seed` or `size`, which are arguments here); `seed`: the dataset's item seed; `size`: how many
    distinct items there are; `instruction`: a line appended to each question ("" for none); `eval_size`: the
    first items, held out for evaluation (training draws from the other `size - eval_size`); `answer`: what of
    the reply is scored, `tag` (its `<answer>` part, else all of it) or `last_number` (its last number)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; available: {', '.join(sorted(DATASETS))}")
    if not (isinstance(eval_size, int) and isinstance(size, int) and 0 < eval_size < size):
        raise ValueError(f"need integers 0 < eval_size < size, got eval_size={eval_size!r} size={size!r}")
    if answer not in EXTRACTIONS:
        raise ValueError(f"answer={answer!r}; valid: {', '.join(repr(e) for e in EXTRACTIONS)}")
    config = dict(config or {})
    for key in ("seed", "size"):
        if key in config:
            raise ValueError(f"config.{key} is set by the env's own `{key}` argument (args.{key}); remove it")
    try:
        made = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)
    except TypeError as exc:  # an unknown config field
        fields = sorted(DATASETS[dataset][1].__dataclass_fields__)
        raise ValueError(f"bad config for {dataset}: {exc}; its fields: {', '.join(fields)}") from None
    except AssertionError as exc:  # reasoning-gym's config.validate() asserts
        raise ValueError(f"invalid config for {dataset}: {exc}") from None
    return ReasoningGymEnv(f"rg-{dataset}", made, instruction, eval_size, answer)
