"""The toy visual task `count-shapes`: images a pure function of the seed, the answer what the pixels show, the
reward's partial credit, a held-out split disjoint from training, and its registration as a plugin."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from config.envs import EnvSpec
from engines.environments import plugins
from engines.environments.base import EnvMix, has_held_out
from engines.environments.shapes import QUADRANT, SIDE, count_shapes
from engines.models.vision import VisionSpec, image_size


def _occupied_quadrants(png: bytes) -> int:
    """Quadrants whose pixels are not all the background colour (the corner pixel is always background)."""
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    background = px[0, 0]
    quads = [px[y : y + QUADRANT, x : x + QUADRANT] for y in (0, QUADRANT) for x in (0, QUADRANT)]
    return sum(bool((q != background).any()) for q in quads)


@pytest.mark.parametrize("images", [1, 2])
def test_tasks_are_seeded_and_the_answer_is_what_the_pixels_show(images):
    env = count_shapes(images=images)
    tasks = [env.sample(random.Random(f"seed/{i}")) for i in range(60)]
    again = [count_shapes(images=images).sample(random.Random(f"seed/{i}")) for i in range(60)]
    assert tasks == again  # same seed, same PNG bytes
    assert len({t.images for t in tasks}) == 60
    spec = VisionSpec(image_token_id=1, vision_start_id=2, vision_end_id=3)
    answers = set()
    for t in tasks:
        assert t.prompt == "count" and len(t.images) == images
        assert all(image_size(png) == (SIDE, SIDE) and spec.tokens(SIDE, SIDE) == 4 for png in t.images)
        assert int(t.answer) == sum(_occupied_quadrants(png) for png in t.images)
        answers.add(t.answer)
    assert len(answers) >= 4 * images  # the counts are spread, not one dominant answer


def test_reward_is_exact_or_partial_credit():
    env = count_shapes()
    task = next(t for t in (env.sample(random.Random(i)) for i in range(50)) if t.answer == "1")
    assert env.reward(task, "1") == 1.0 and env.reward(task, " 1\n") == 1.0
    assert env.reward(task, "2") == 0.5 and env.reward(task, "0") == 0.5  # off by one: half
    assert env.reward(task, "3") == 0.0 and env.reward(task, "9") == 0.0
    assert env.reward(task, "") == 0.0 and env.reward(task, "one") == 0.0
    wide = count_shapes(credit=4)
    assert wide.reward(task, "3") == 0.5 and wide.reward(task, "2") == 0.75 and wide.reward(task, "5") == 0.0


def test_held_out_split_is_disjoint_and_fixed():
    env = count_shapes(eval_size=30)
    assert has_held_out(env)
    held = [env.eval_task(i) for i in range(env.eval_size)]
    assert held[:5] == [count_shapes(eval_size=30).eval_task(i) for i in range(5)]
    rng = random.Random(0)
    drawn = {env.sample(rng).images for _ in range(600)}
    assert not {t.images for t in held} & drawn
    assert len({t.images for t in held}) == 30


def test_plugin_entry_and_bad_args():
    env = plugins.build(EnvSpec(id="count-shapes", args={"images": 2}))
    plugins.smoke(env)
    mix = EnvMix([EnvSpec(id="count-shapes", name="vis", args={"images": 2})], seed=7)
    task = mix.task("step=1/group=0")
    assert task.env == "vis" and len(task.images) == 2 and mix.reward(task, task.answer) == 1.0
    for bad in ({"images": 3}, {"images": 0}, {"min_size": 1}, {"max_size": 31}, {"eval_size": 0}, {"credit": 0}):
        with pytest.raises(plugins.PluginError):
            plugins.build(EnvSpec(id="count-shapes", args=bad))
