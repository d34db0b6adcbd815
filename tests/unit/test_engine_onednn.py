"""`inference.onednn_linear` (engines/inference/embedded/packed.py): the engine's Linear layers on oneDNN packed
weights draw the tokens MKL's draw, with logprobs within float32 rounding, and follow a weight update."""

from __future__ import annotations

import copy

import pytest
import torch

from config.model import ModelConfig
from engines.inference.embedded.generate import generate
from engines.inference.embedded.packed import available, pack_linears
from engines.models.decoder import CausalLM

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN linear")


def _sample(model: CausalLM) -> tuple[list[list[int]], list[list[float]]]:
    prompts = [[1 + (i * 7 + j) % 90 for j in range(5 + i % 4)] for i in range(6) for _ in range(4)]
    n = len(prompts)
    out = generate(
        model, prompts, max_new_tokens=[12] * n, temperatures=[1.0] * n, eos_id=-1, pad_id=0, seeds=list(range(n))
    )
    return [c.token_ids for c in out], [c.logprobs for c in out]


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_packed_linears_sample_the_same_tokens_and_follow_weight_updates():
    torch.manual_seed(0)
    plain = CausalLM(ModelConfig(hidden_size=128, num_layers=2, intermediate_size=256), 100).eval()
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    tokens, logprobs = _sample(plain)
    got_tokens, got_logprobs = _sample(packed)
    assert got_tokens == tokens and _close(got_logprobs, logprobs) < 1e-4
    with torch.no_grad():  # a weight update writes the parameters in place: the packed copies must follow
        for model in (plain, packed):
            for p in model.parameters():
                p.mul_(1.5)
    tokens2, logprobs2 = _sample(plain)
    got_tokens2, got_logprobs2 = _sample(packed)
    assert tokens2 != tokens  # the update changed what is sampled ...
    assert got_tokens2 == tokens2 and _close(got_logprobs2, logprobs2) < 1e-4  # ... and the packed model follows
