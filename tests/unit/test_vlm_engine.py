"""The embedded engine on a tiny Qwen3-VL: image prompts are prefilled with their images (multimodal RoPE
positions), their sampled tokens' logprobs are the model's own (a full forward), rows with images join a running
batch, and two prompts with the same ids and other images never share a prefill."""

from __future__ import annotations

import pytest
import torch

from engines.inference.embedded.engine import Engine, Request
from engines.inference.embedded.generate import Decoder, Sampling
from engines.inference.embedded.prefill import unique_prompts
from engines.models import vision
from tests.vlm_fixture import load, png, prompt, reference_logprobs, tiny_vlm_dir, token  # noqa: F401 (a fixture)

# Largest |engine logprob - full forward logprob| allowed, float32: measured 9.5e-7 (a cached, batched, left-padded
# decode against one unpadded forward), so a wrong position or a shared prefill (differences of 1e-2 and more)
# cannot pass.
BOUND = 1e-5


@pytest.fixture(scope="module")
def model(tiny_vlm_dir):  # noqa: F811 (the fixture)
    return load(tiny_vlm_dir)


def test_image_rows_match_a_full_forward_also_when_they_join_a_running_batch(model):
    engine = Engine(model, 0, token("<eos>"), token("<pad>"), max_batch_size=8, seed=0)
    red, blue, green = png(1), png(2), png(3, 96, 64)
    later = [
        Request(prompt("two", [blue, green]), n=2, max_tokens=12, temperature=1.0, seed=2, images=(blue, green)),
        Request(prompt("none", []), n=1, max_tokens=12, temperature=1.0, seed=3),
    ]

    def first_tokens(events) -> None:  # on the engine's thread after A's first step: B and C queue behind it
        while later:
            joining.append(engine.submit(later.pop(0)))

    joining: list = []
    first = Request(prompt("one", [red]), n=2, max_tokens=24, temperature=1.0, seed=1, ignore_eos=True, images=(red,))
    first.on_tokens = first_tokens
    try:
        outs = [engine.submit(first).result(timeout=60)]
        assert len(joining) == 2
        outs += [f.result(timeout=60) for f in joining]
    finally:
        engine.stop()
    assert engine.stats["batches"] == 1 and engine.stats["joins"] >= 2, engine.stats  # they joined A's batch
    cases = [(prompt("one", [red]), [red]), (prompt("two", [blue, green]), [blue, green]), (prompt("none", []), [])]
    gaps = []
    for (ids, images), completions in zip(cases, outs, strict=True):
        for c in completions:
            assert c.token_ids
            ref = reference_logprobs(model, ids, images, c.token_ids)
            gaps += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    assert len(gaps) == sum(len(c.token_ids) for o in outs for c in o) >= 2 * 24 + 3
    print(f"largest logprob gap {max(gaps):.2e} over {len(gaps)} tokens")
    assert max(gaps) < BOUND, max(gaps)


def test_equal_ids_with_other_images_get_their_own_prefill(model):
    red, blue = png(1), png(2)
    ids = prompt("same", [red])
    assert ids == prompt("same", [blue])
    unique, rows = unique_prompts([ids, ids, ids], [(red,), (blue,), (red,)])
    assert rows == [0, 1, 0] and len(unique) == 2
    decoder = Decoder(model, token("<eos>"), token("<pad>"))
    decoder.add([ids, ids, ids], [Sampling(max_tokens=2, seed=s) for s in range(3)], [(red,), (blue,), (red,)])
    with torch.no_grad():
        inputs = [vision.pixel_inputs([b], model.vision_spec) for b in (red, blue)]
        want = [model(torch.tensor([ids]), vision=v)[0, -1] for v in inputs]
    got = decoder.logits
    assert (want[0] - want[1]).abs().max() > 1e-3  # the images do change the next token's logits
    for row, image in enumerate([0, 1, 0]):
        assert torch.allclose(got[row], want[image], atol=1e-5), row
