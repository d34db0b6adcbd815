"""engines/trainer/layout.py prefix sharing: a group's prompt forwarded once gives the padded forward's logprobs,
loss and gradients, and is used only where it saves FLOPs."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from config.trainer import TrainerConfig
from engines.trainer import flops
from engines.trainer.batch import Batch, PackedBatch, make_batch, micro_batches, sample_lengths
from engines.trainer.common import batch_logprobs, scored_tokens
from engines.trainer.layout import Layout, TokenCost, forward_tokens, shared_units
from engines.trainer.losses.objective import Objective, StepCounts, token_scores
from tests.unit.test_packing import TOK, _model

COST = TokenCost(*flops.token_cost(_model()))


def _groups(seed: int = 0, groups: int = 5, size: int = 4, completion: tuple[int, int] = (1, 9)) -> pa.Table:
    """`groups` prompts of 4-10 tokens, each sampled `size` times; completions include the pad id, temperatures
    differ within a group (each span must use its own)."""
    g = torch.Generator().manual_seed(seed)
    cols: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "completion_logprobs", "temperature")}
    for i in range(groups):
        prompt = [TOK.bos_id] + torch.randint(4, TOK.vocab_size, (3 + i % 7,), generator=g).tolist()
        for j in range(size):
            n = int(torch.randint(completion[0], completion[1], (1,), generator=g))
            cols["prompt_ids"].append(prompt)
            cols["completion_ids"].append(torch.randint(0, TOK.vocab_size, (n,), generator=g).tolist())
            cols["completion_logprobs"].append((-torch.rand(n, generator=g) * 3).tolist())
            cols["temperature"].append((1.0, 0.7, 1.3)[j % 3])
    rows = len(cols["prompt_ids"])
    versions = {"policy_version": [0] * rows, "policy_version_end": [0] * rows}
    return pa.table({**cols, "advantage": torch.randn(rows, generator=g).tolist(), **versions})


def _by_key(mb: Batch | PackedBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """The scored tokens' logprobs ordered by their (distinct, random) sampler logprobs: layout-independent."""
    mask = mb.loss_mask.bool()
    return logprobs[mask][torch.argsort(mb.sampler_logprobs[mask])]


def test_shared_rows_score_every_completion_token_as_the_padded_forward():
    batch = make_batch(_groups(), TOK.pad_id)
    mbs = Layout(3, TOK.pad_id, share=COST).split(batch)
    assert all(isinstance(mb, PackedBatch) and mb.prefixes is not None for mb in mbs)
    packed = [mb for mb in mbs if isinstance(mb, PackedBatch)]
    assert sum(forward_tokens(mb) for mb in packed) < sum(sample_lengths(batch))
    model = _model().eval()
    with torch.no_grad():
        want = _by_key(batch, batch_logprobs(model, batch))
        got = [scored_tokens(model, mb).logprobs for mb in packed]
    keys = torch.cat([mb.sampler_logprobs[mb.loss_mask.bool()] for mb in packed])
    values = torch.cat([lp[mb.loss_mask.bool()] for lp, mb in zip(got, packed, strict=True)])
    assert len(values) == int(batch.loss_mask.sum())
    # measured: at most 1.4e-6 apart on logprobs down to about -50 (fp32 rounding of other matmul shapes); a
    # token seeing a sibling's completion, or missing its prompt, moves by ~1
    torch.testing.assert_close(values[torch.argsort(keys)], want, rtol=0, atol=5e-6)


def test_shared_rows_give_the_padded_loss_and_gradients():
    batch = make_batch(_groups(seed=1), TOK.pad_id)
    counts = StepCounts(float(batch.loss_mask.sum()), len(batch))

    def grads(parts: list) -> tuple[float, list[torch.Tensor]]:
        model = _model()
        total = 0.0
        for mb in parts:
            loss, _ = Objective(TrainerConfig())(token_scores(mb, scored_tokens(model, mb).logprobs), counts)
            loss.backward()
            total += float(loss.detach())
        return total, [p.grad.clone() for p in model.parameters()]

    loss_padded, g_padded = grads(micro_batches(batch, 4))
    loss_shared, g_shared = grads(Layout(4, TOK.pad_id, share=COST).split(batch))
    # measured: loss 7.9e-9 apart, gradients at most 1.6e-8
    assert loss_shared == pytest.approx(loss_padded, abs=5e-8)
    for a, b in zip(g_shared, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_a_row_never_lets_a_completion_see_its_siblings():
    batch = make_batch(_groups(groups=1, size=3), TOK.pad_id)
    (mb,) = Layout(8, TOK.pad_id, share=COST).split(batch)
    assert isinstance(mb, PackedBatch) and mb.prefixes is not None
    mask = mb.attention_mask()[0, 0]
    segments, prefix = mb.segments[0], mb.prefixes[0]
    shared = int(((segments < 0) & (prefix >= 0)).sum())
    assert shared == int(batch.prompt_lengths[0]) - 1  # the prompt but its last token, once
    for q in range(mb.input_ids.shape[1]):
        for k in range(mb.input_ids.shape[1]):
            own = segments[q] >= 0 and segments[k] == segments[q]
            prompt = prefix[q] >= 0 and segments[k] < 0 and prefix[k] == prefix[q]
            assert bool(mask[q, k]) == (k == q or (k <= q and bool(own or prompt)))


def test_groups_share_only_where_it_saves_flops():
    short = make_batch(_groups(seed=2, completion=(1, 4)), TOK.pad_id)
    long = make_batch(_groups(seed=2, completion=(120, 140)), TOK.pad_id)  # 4-10 prompt tokens, ~130 after
    budget = 10_000
    assert all(u.shared for u in shared_units(short, COST, budget))
    assert not any(u.shared for u in shared_units(long, COST, budget))
    # nothing shared and packing off: the padded micro-batches, as without prefix sharing
    mbs = Layout(4, TOK.pad_id, share=COST).split(long)
    assert all(isinstance(mb, Batch) for mb in mbs)


def test_a_group_longer_than_the_budget_is_split_each_part_with_its_prompt():
    batch = make_batch(_groups(seed=3, groups=1, size=8, completion=(5, 6)), TOK.pad_id)
    lengths = sample_lengths(batch)
    units = shared_units(batch, COST, budget=2 * max(lengths))
    assert sorted(i for u in units for i in u.members) == list(range(8))
    assert len(units) > 1 and all(u.shared and u.size(lengths) <= 2 * max(lengths) for u in units)


def test_rows_without_a_trained_token_and_measured_tokens_keep_their_places():
    batch = make_batch(_groups(seed=4), TOK.pad_id)
    batch.loss_mask[1::4] = 0.0  # the zero-advantage filter's rows: nothing left to train, nothing measured
    batch.measured = batch.loss_mask.clone()
    batch.measured[::3] = 0.0
    mbs = Layout(4, TOK.pad_id, share=COST).split(batch)
    for name in ("loss_mask", "measured"):
        assert float(sum(getattr(mb, name).sum() for mb in mbs)) == float(getattr(batch, name).sum())
