"""Prompts with images (engines/orchestrator/prompts.py) against the tiny Qwen3-VL directory: rendered as content
parts, each placeholder expanded to its image's tokens, the images sent as base64; a group whose multi-image
prompt would overflow model.max_seq_len is dropped before any request and counted, and the pool draws another
group in its place; a text-only model refuses image tasks; endless drops refuse the run."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import pytest

from config.loader import load_run_config
from config.process import component_configs
from engines.environments.base import EnvironmentRefused, Task
from engines.environments.shapes import count_shapes
from engines.models import tiny_vlm, vision
from engines.models.tokenizer import CharTokenizer, HFTokenizer
from engines.orchestrator.loop import Orchestrator, WeightSync
from engines.orchestrator.pool import GroupPool
from engines.orchestrator.prompts import MAX_DROP_STREAK, Prompts
from engines.protocol import CompletionRequest
from storage.fs import Storage
from tests.vlm_fixture import tiny_vlm_dir  # noqa: F401 (a fixture)

CLOSED = "http://127.0.0.1:9"  # nothing listens: a request that is sent fails with a ConnectError


@pytest.fixture
def vlm_dir(tiny_vlm_dir):  # noqa: F811
    return tiny_vlm_dir


def test_image_prompt_is_rendered_expanded_and_carries_its_images(vlm_dir):
    tok = HFTokenizer(vlm_dir)
    task = count_shapes(images=2).sample(random.Random(3))
    prompt = Prompts(tok, max_seq_len=512, max_new_tokens=12).render(task)
    assert prompt is not None and prompt.images == task.images
    spec = tiny_vlm.spec()
    sizes = [vision.image_size(b) for b in task.images]
    vision.check_prompt(prompt.ids, sizes, spec)  # one run of 4 image tokens per 64 x 64 image
    assert [n for _, n in vision.image_runs(prompt.ids, spec)] == [4, 4]
    assert prompt.ids[0] == tok.bos_id and tok.decode(prompt.ids) == "count="
    fields = prompt.request_fields()
    assert [base64.b64decode(s) for s in fields["images"]] == list(task.images)
    CompletionRequest(prompt=prompt.ids, max_tokens=12, **fields)  # the protocol takes it as sent
    text = Task("x", "count", "0")
    assert Prompts(tok, 512, 12).render(text).ids == tok.render_prompt("count")  # text prompts as before


def _orchestrator(vlm_dir, tmp_path, max_seq_len: int, url: str = CLOSED) -> Orchestrator:
    """The orchestrator of a tiny-cpu run on `vlm_dir` drawing count-shapes with 2 images, its server at `url`."""
    overrides = [
        ("output-dir", str(tmp_path / f"run{max_seq_len}")),
        ("model.path", str(vlm_dir)),
        ("model.impl", "hf"),
        ("model.max_seq_len", str(max_seq_len)),
        ("envs", '[{id = "count-shapes", args = {images = 2}}]'),
    ]
    ocfg = component_configs(load_run_config(["profiles/tiny-cpu.toml"], overrides), "run-1", url)["orchestrator"]
    fs, root = Storage(ocfg.run.storage).open(ocfg.run.output_dir)
    return Orchestrator(ocfg, httpx.AsyncClient(base_url=url, timeout=60), WeightSync(None, fs, root, "", 1.0))


def test_an_overflowing_multi_image_group_is_dropped_before_any_request_and_counted(vlm_dir, tmp_path):
    # 2 images: <bos> + 2 x (start, 4 image tokens, end) + "count=" = 19 tokens; + max_new_tokens 12 > 24
    orch = _orchestrator(vlm_dir, tmp_path, max_seq_len=24)
    group_size = orch.ocfg.group_size
    assert asyncio.run(orch.scored_group(1, 0)) == []  # no request: the closed port would have raised
    assert asyncio.run(orch.scored_group(1, 1)) == []
    assert orch.prompts.take_counts() == {"overflow_dropped": 2 * group_size}
    assert orch.prompts.take_counts() == {}  # counted once, into the step that commits next
    fits = _orchestrator(vlm_dir, tmp_path, max_seq_len=31)  # 19 + 12 = 31: fits exactly, so it is sent
    with pytest.raises(httpx.ConnectError):
        asyncio.run(fits.scored_group(1, 0))
    assert fits.prompts.take_counts() == {}


def test_the_pool_replaces_a_dropped_group():
    async def start(step: int, group: int) -> list:
        return [] if group == 0 else [f"row-{group}"]

    async def take():
        pool = GroupPool(start, size=2, batch=2)
        pool.top_up(1)
        return await pool.take(1, bool)

    taken = asyncio.run(take())
    assert list(taken.groups) == ["s000001-g0001", "s000001-g0002"]
    assert taken.aged_out == ["s000001-g0000"] and taken.dispatched == ["s000001-g0002"]


def test_bad_images_are_counted_text_models_refuse_and_endless_drops_stop(vlm_dir):
    tok = HFTokenizer(vlm_dir)
    broken = Task("count-shapes", "count", "1", images=(b"not an image",))
    prompts = Prompts(tok, 512, 12)
    assert prompts.render(broken, samples=8) is None
    assert prompts.take_counts() == {"image_refused": 8}
    good = count_shapes().sample(random.Random(0))
    with pytest.raises(EnvironmentRefused, match="not a vision-language model"):
        Prompts(CharTokenizer(), 512, 12).render(good)
    tight = Prompts(tok, max_seq_len=12, max_new_tokens=12)
    for _ in range(MAX_DROP_STREAK - 1):
        assert tight.render(good) is None
    with pytest.raises(EnvironmentRefused, match=f"{MAX_DROP_STREAK} prompts with images in a row"):
        tight.render(good)


def test_the_load_check_measures_image_prompts_with_their_image_tokens(vlm_dir):
    from config.envs import EnvSpec
    from engines.environments import loadcheck

    specs = [EnvSpec(id="count-shapes"), EnvSpec(id="count-shapes", name="two", args={"images": 2})]
    facts, problems = loadcheck.inspect(specs, ["p.toml", "p.toml"], "tag", HFTokenizer(vlm_dir))
    # <bos> + per image (start, 4 image tokens, end) + "count" + "=": what the orchestrator sends
    assert not problems and [f.longest_prompt for f in facts] == [13, 19]
    facts, problems = loadcheck.inspect(specs[:1], ["p.toml"], "tag", CharTokenizer())
    assert not facts and "not a vision-language model" in problems[0]
