"""Held-out splits: every evaluable built-in environment's `eval_task`s are fixed, and `sample` never draws one."""

from __future__ import annotations

import random

import pytest

from engines.environments.base import has_held_out, reverse_text, sort_letters
from engines.environments.rgym import load


@pytest.mark.parametrize("factory", [reverse_text, sort_letters])
def test_string_task_splits_are_disjoint_and_fixed(factory):
    env = factory(min_chars=3, max_chars=3, eval_size=50)
    assert has_held_out(env)
    held = {env.eval_task(i).prompt for i in range(env.eval_size)}
    assert [env.eval_task(i) for i in range(5)] == [factory(3, 3, eval_size=50).eval_task(i) for i in range(5)]
    rng = random.Random(0)
    drawn = {env.sample(rng).prompt for _ in range(3000)}
    assert not held & drawn
    assert len(drawn) > 1500  # 3-letter payloads: a small space, so an overlap would show


def test_reasoning_gym_holds_out_its_first_items():
    env = load("spell_backward", size=300, eval_size=20)
    held = {env.eval_task(i).prompt for i in range(20)}
    rng = random.Random(0)
    drawn = {env.sample(rng).prompt for _ in range(2000)}
    assert not held & drawn
    with pytest.raises(IndexError, match="out of range"):
        env.eval_task(20)
    with pytest.raises(ValueError, match="eval_size < size"):
        load("spell_backward", size=10, eval_size=10)


def test_reasoning_gym_scores_the_last_number_when_asked():
    env = load("basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    task = env.eval_task(0)
    assert env.reward(task, f"The answer is {task.answer}.") < 0.2  # strict: the whole reply is the answer
    lenient = load(
        "basic_arithmetic",
        config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        answer="last_number",
    )
    assert lenient.reward(task, f"The answer is {task.answer}.") == 1.0
    assert lenient.reward(task, f"{task.answer} plus 1 is 99") < 0.2
    with pytest.raises(ValueError, match="last_number"):
        load("basic_arithmetic", answer="first")
