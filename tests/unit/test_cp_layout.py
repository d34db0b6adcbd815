"""Context parallelism's pieces without a process group: the local attention mask of each cp rank is the
matching block of the whole row's mask, and the packed layout of an unpacked micro-batch scores the same
logprobs. (2 gloo ranks against 1 process: tests/integration/test_context_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from config.model import ModelConfig
from engines.models.decoder import CausalLM
from engines.trainer import compat
from engines.trainer.batch import Batch, PackedBatch, pack_batch
from engines.trainer.common import batch_logprobs, packed_logprobs
from engines.trainer.context_parallel import CPShard, _padded, to_packed_layout


def _batch(rows: int = 5, length: int = 11) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 50, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    for i in range(rows):  # sample i: 4 + i tokens, the last two targets completion tokens
        mask[i, 1 + i : 3 + i] = 1.0
    return Batch(
        ids, ids[:, 1:], mask, -torch.rand(rows, length - 1, generator=g) * mask, torch.randn(rows, generator=g),
        torch.full((rows,), 0.7), torch.zeros(rows), torch.zeros(rows),
    )  # fmt: skip


def _local(full: PackedBatch, cp: int, rank: int) -> CPShard:
    """Rank `rank`'s shard as `shard` builds it (torch's head-tail order, chunk `rank` of it)."""
    order = compat.head_tail_order(full.input_ids.shape[1], cp, "cpu")
    mine = order.view(cp, -1)[rank]
    return CPShard(
        input_ids=full.input_ids[:, mine], positions=full.positions[:, mine], segments=full.segments[:, mine],
        targets=full.targets[:, mine], loss_mask=full.loss_mask[:, mine],
        sampler_logprobs=full.sampler_logprobs[:, mine], advantages=full.advantages[:, mine],
        temperatures=full.temperatures[:, mine], query_index=mine, key_index=order,
        key_segments=full.segments[:, order],
    )  # fmt: skip


@pytest.mark.parametrize("cp", [2, 3])
def test_each_ranks_mask_is_its_block_of_the_whole_rows_mask(cp):
    full = _padded(pack_batch(_batch(), pad_id=0, capacity=19), 2 * cp)
    assert full.input_ids.shape[1] % (2 * cp) == 0 and (full.segments[:, 19:] == -1).all()
    whole = full.attention_mask()
    for rank in range(cp):
        local = _local(full, cp, rank)
        expected = whole[:, :, local.query_index][:, :, :, local.key_index]
        assert torch.equal(local.attention_mask(), expected)
    owned = torch.cat([_local(full, cp, r).query_index for r in range(cp)])
    assert sorted(owned.tolist()) == list(range(full.input_ids.shape[1]))  # every token on exactly one rank


def test_the_packed_layout_of_an_unpacked_batch_scores_the_same_logprobs():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), 50).eval()
    batch = _batch()
    packed = to_packed_layout(batch)
    assert packed.advantages.shape == packed.input_ids.shape
    with torch.no_grad():
        plain = batch_logprobs(model, batch)
        mine = packed_logprobs(model, packed)[:, :-1]
    torch.testing.assert_close(mine * batch.loss_mask, plain * batch.loss_mask, rtol=0, atol=1e-6)
