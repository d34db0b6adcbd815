"""engines/inference/embedded/generate.py batching savings: shared prefill for repeated prompts and compaction of
finished rows
change no sample, logprob or policy version (each row equals the same row generated alone)."""

from __future__ import annotations

import torch

from config.model import ModelConfig
from engines.inference.embedded.generate import generate
from engines.inference.embedded.prefill import unique_prompts
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _model() -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(CFG, TOK.vocab_size).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)  # peaked outputs, so a common token exists
    return model


def _stop_tokens(model: CausalLM, prompts: list[list[int]]) -> list[int]:
    """Tokens the model samples, most frequent first: stop-token candidates that end rows at varied steps."""
    outs = generate(
        model, prompts, max_new_tokens=[6] * len(prompts), temperatures=[1.0] * len(prompts), eos_id=-1,
        pad_id=TOK.pad_id, seeds=list(range(len(prompts))),
    )  # fmt: skip
    counts = torch.tensor([t for c in outs for t in c.token_ids]).bincount()
    return [int(t) for t in counts.argsort(descending=True) if counts[t] > 0]


def test_unique_prompts_keeps_first_seen_order():
    unique, rows = unique_prompts([[1, 2], [3], [1, 2], [3], [4]])
    assert unique == [[1, 2], [3], [4]] and rows == [0, 1, 0, 1, 2]


def test_groups_and_early_finishers_match_rows_generated_alone():
    model = _model()
    texts = ["rev:abc=", "sort:qwertyu=", "x="]
    prompts = [TOK.encode(t) for t in texts for _ in range(4)]  # groups of 4 share a prompt
    limits = [3, 9, 14, 5] * 3
    temps = [1.0, 0.7, 1.3, 1.0] * 3
    seeds = list(range(100, 112))
    calls = 0

    def between_steps() -> int:
        nonlocal calls
        calls += 1
        return calls // 4  # the version moves during the batch, as with in-flight updates

    for eos in _stop_tokens(model, prompts):  # one that stops some rows early and lets others run out
        calls = 0
        out = generate(
            model, prompts, max_new_tokens=limits, temperatures=temps, eos_id=eos, pad_id=TOK.pad_id,
            seeds=seeds, between_steps=between_steps,
        )  # fmt: skip
        early = [c for c, limit in zip(out, limits, strict=True) if len(c.token_ids) < limit]
        if early and len(early) < len(out):
            break
    else:
        raise AssertionError("no stop token gives both early and full-length rows")
    for i, c in enumerate(out):
        alone = generate(
            model, [prompts[i]], max_new_tokens=[limits[i]], temperatures=[temps[i]], eos_id=eos,
            pad_id=TOK.pad_id, seeds=[seeds[i]],
        )[0]  # fmt: skip
        assert c.token_ids == alone.token_ids
        assert c.finish_reason == alone.finish_reason
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
        assert c.policy_version == 0
        assert c.policy_version_end == (len(c.token_ids) - 1 + 1) // 4  # call k precedes token k (1-based)
