"""Keep sampling mask: the sampler records the support its top-k / top-p truncation kept, the lake stores it
(`completion_kept`), and the trainer scores each sampled token on exactly that support."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from config.inference import InferenceConfig
from config.model import ModelConfig
from config.orchestrator import OrchestratorConfig
from config.trainer import TrainerConfig
from config.transport import WeightBroadcastConfig
from engines import protocol as api
from engines.environments.episodes import Episode
from engines.inference.backend import check
from engines.inference.embedded.generate import Decoder, Sampling
from engines.inference.embedded.sampling import truncate, truncate_kept
from engines.models.decoder import CausalLM
from engines.orchestrator.multiturn import truncation
from engines.registry import PluginError
from engines.trainer.batch import make_batch, pack_batch
from engines.trainer.common import (
    batch_logprobs,
    packed_logprobs,
    restricted_logprobs,
    scored_tokens,
    train_logprobs,
)
from storage import rollouts
from storage.fs import commit_dir, get_fs

VOCAB = 12


def _brute(z: torch.Tensor, y: int, support: list[int]) -> tuple[float, float]:
    """(logprob of y, entropy) of softmax(z) restricted to `support`, by explicit enumeration."""
    zs = z[support]
    logz = torch.logsumexp(zs, 0)
    lps = zs - logz
    return float(z[y] - logz), float(-(lps.exp() * lps).sum())


def test_restricted_logprob_matches_the_explicit_support():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, VOCAB, generator=g, dtype=torch.float64) * 3
    order = z.argsort(-1, descending=True)
    kept = torch.randint(1, VOCAB + 1, (200,), generator=g)
    kept[:10], kept[10:20] = 1, VOCAB  # k = 1 and k = vocab both appear
    # a target inside each row's top k, drawn uniformly among them
    pick = (torch.rand(200, generator=g, dtype=torch.float64) * kept).long()
    y = order.gather(-1, pick[:, None]).squeeze(-1)
    got = restricted_logprobs(z, y, kept, entropy=True)
    assert got.support_mismatch_tokens == 0
    for i in range(200):
        lp, ent = _brute(z[i], int(y[i]), order[i, : int(kept[i])].tolist())
        assert abs(float(got.logprobs[i]) - lp) <= 1e-12
        assert abs(float(got.entropy[i]) - ent) <= 1e-12
    assert torch.all(got.logprobs[:10] == 0)  # k = 1: the only token kept
    full = torch.log_softmax(z[10:20], -1).gather(-1, y[10:20, None]).squeeze(-1)
    assert torch.equal(got.logprobs[10:20], full)  # k = vocab is the full vocabulary, bit for bit


def test_full_vocabulary_positions_are_bit_identical():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 7, VOCAB, generator=g)
    y = torch.randint(0, VOCAB, (4, 7), generator=g)
    kept = torch.zeros(4, 7, dtype=torch.long)
    kept[1, 2:5] = 3  # some positions truncated: the rest must not move at all
    got = restricted_logprobs(z, y, kept)
    full = torch.log_softmax(z, -1).gather(-1, y[..., None]).squeeze(-1)
    assert torch.equal(got.logprobs[kept == 0], full[kept == 0])
    assert not torch.equal(got.logprobs[kept > 0], full[kept > 0])


def test_boundary_tie_falls_back_to_top_k_minus_one_plus_the_sampled_token():
    # the sampler kept 3 and drew token 5; the trainer ranks 5 fourth (a near tie with token 2 at the boundary)
    z = torch.tensor([[4.0, 3.0, 2.0 + 1e-9, 0.5, -1.0, 2.0, -3.0]], dtype=torch.float64)
    y = torch.tensor([5])
    got = restricted_logprobs(z, y, torch.tensor([3]), entropy=True)
    lp, ent = _brute(z[0], 5, [0, 1, 5])
    assert got.support_mismatch_tokens == 1
    assert abs(float(got.logprobs[0]) - lp) <= 1e-12 and abs(float(got.entropy[0]) - ent) <= 1e-12
    # k = 1 and the trainer's argmax is another token: the support is the sampled token alone
    one = restricted_logprobs(z, y, torch.tensor([1]), entropy=True)
    assert float(one.logprobs[0]) == 0.0 and float(one.entropy[0]) == 0.0 and one.support_mismatch_tokens == 1
    # an exact tie at the boundary is inside (ranked by value, not by sort position): no fallback
    tied = z.clone()
    tied[0, 2] = 2.0
    got = restricted_logprobs(tied, y, torch.tensor([3]))
    assert got.support_mismatch_tokens == 0
    assert abs(float(got.logprobs[0]) - _brute(tied[0], 5, [0, 1, 5])[0]) <= 1e-12


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (0, 0.5), (5, 1.0), (20, 1.0), (3, 0.8)])
def test_kept_sizes_count_the_finite_entries_of_truncate(top_k, top_p):
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(64, 49, generator=g) * 2, -1)
    ks, ps = torch.full((64,), top_k), torch.full((64,), top_p)
    out, kept = truncate_kept(logp, ks, ps)
    assert torch.equal(out, truncate(logp, ks, ps))
    assert torch.equal(kept, out.isfinite().sum(-1))
    assert bool((kept < 49).all())  # it did truncate, at these settings
    if top_k:
        assert bool((kept <= top_k).all())


def _tiny_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=32)
    return CausalLM(cfg, 49).eval()


def test_engine_records_the_kept_size_of_each_drawn_token():
    model = _tiny_model()
    decoder = Decoder(model, eos_id=-1, pad_id=0)
    params = [
        Sampling(max_tokens=4, temperature=0.7, seed=1, top_p=0.9, kept_sizes=True),
        Sampling(max_tokens=4, temperature=1.0, seed=2, top_k=5, kept_sizes=True),
        Sampling(max_tokens=4, temperature=1.0, seed=3, top_k=5),  # does not ask
    ]
    made = decoder.add([[1, 5, 6], [1, 7], [1, 7]], params)
    for _ in range(4):
        rows = decoder.rows
        assert rows is not None
        logp = torch.log_softmax(decoder.logits.float() / rows.temps, -1)
        expect = truncate(logp, rows.top_k, rows.top_p).isfinite().sum(-1).tolist()
        expect_of = dict(zip(rows.origin.tolist(), expect, strict=True))
        stepped = decoder.sample(0)
        for o, c in made:
            if o in stepped and o != made[2][0]:
                assert c.kept_sizes[-1] == expect_of[o]
        if not decoder.live:
            break
        decoder.forward()
    first, second, third = (c for _, c in made)
    assert len(first.kept_sizes) == len(first.token_ids) and len(second.kept_sizes) == len(second.token_ids)
    assert all(1 <= k < 49 for k in first.kept_sizes) and all(k == 5 for k in second.kept_sizes)
    assert third.kept_sizes == []


def test_protocol_and_orchestrator_requests():
    assert truncation(OrchestratorConfig()) == {}
    fields = truncation(OrchestratorConfig(top_p=0.9))
    assert fields == {"top_p": 0.9, "top_k": 0, "return_kept_sizes": True}
    body = api.CompletionRequest(prompt=[1, 2], **fields).model_dump(exclude_none=True)
    assert body["return_kept_sizes"] is True
    assert "return_kept_sizes" not in api.CompletionRequest(prompt=[1]).model_dump(exclude_none=True)
    with pytest.raises(ValueError, match="return_kept_sizes"):
        api.CompletionRequest(prompt=[1], return_kept_sizes=True, stream=True)
    with pytest.raises(ValueError):
        OrchestratorConfig(top_p=0.0)
    with pytest.raises(ValueError):
        OrchestratorConfig(top_k=-1)


def _choice(ids: list[int], kept: list[int] | None) -> api.CompletionChoice:
    lps = api.CompletionLogprobs(tokens=["x"] * len(ids), token_logprobs=[-0.5] * len(ids))
    return api.CompletionChoice(index=0, text="x", finish_reason="stop", logprobs=lps, token_ids=ids,
                                policy_version=0, policy_version_end=0, kept_sizes=kept)  # fmt: skip


def test_multi_turn_rows_hold_zero_on_environment_tokens():
    e = Episode(prompt_ids=[1, 2])
    e.add_turn(_choice([5, 6], [7, 3]))
    e.add_environment([9, 9, 9])
    e.add_turn(_choice([4], [2]))
    assert e.completion_kept == [7, 3, 0, 0, 0, 2]
    plain = Episode(prompt_ids=[1])
    plain.add_turn(_choice([5], None))
    assert plain.kept_returned is False


def test_backend_refuses_truncation_without_the_support():
    inf, wb = InferenceConfig(backend="vllm"), WeightBroadcastConfig()
    check(inf, wb, OrchestratorConfig(), TrainerConfig())  # no truncation: fine
    for o in (OrchestratorConfig(top_p=0.9), OrchestratorConfig(top_k=20)):
        with pytest.raises(PluginError, match="keep_sampling_mask false"):
            check(inf, wb, o, TrainerConfig())
        check(inf, wb, o, TrainerConfig(keep_sampling_mask=False))  # the biased ratio, accepted
        check(InferenceConfig(), wb, o, TrainerConfig())  # the embedded engine records it


def _row(k: int, kept: list[int] | None, completion: list[int]) -> dict:
    return {
        "run_id": "r", "step": 1, "sample_id": f"s000001-g0000-{k:02d}", "group_id": "s000001-g0000",
        "env": "reverse-text", "policy_version": 0, "policy_version_end": 0, "prompt_ids": [1, 20 + k, 21],
        "completion_ids": completion, "completion_logprobs": [-1.0] * len(completion), "reward": 0.5,
        "advantage": 0.1 * k, "temperature": 0.8, "finish_reason": "stop", "prompt_text": "p",
        "completion_text": "c", "completion_kept": kept,
    }  # fmt: skip


def _table() -> pa.Table:
    rows = [
        _row(0, [5, 3, 49], [30, 31, 2]),
        _row(1, None, [32, 2]),
        _row(2, [2, 7, 1, 4, 9], [33, 34, 35, 36, 2]),
        _row(3, [1], [2]),
    ]
    return rollouts.to_table(rows)


def test_make_batch_aligns_kept_sizes_with_targets():
    table = _table()
    batch = make_batch(table, pad_id=0)
    assert batch.kept is not None and batch.kept.shape == batch.targets.shape
    assert batch.kept[0, 2:5].tolist() == [5, 3, 49] and batch.kept[0].sum() == 57
    assert batch.kept[1].sum() == 0  # a null row: full vocabulary
    assert batch.kept[2, 2:7].tolist() == [2, 7, 1, 4, 9]
    assert make_batch(table, pad_id=0, keep_sampling_mask=False).kept is None
    with pytest.raises(ValueError, match="completion_kept"):
        rollouts.to_table([_row(0, [5], [30, 2])])


def test_packing_preserves_kept_sizes_and_logprobs():
    model = _tiny_model(3)
    batch = make_batch(_table(), pad_id=0)
    with torch.no_grad():
        padded = scored_tokens(model, batch)
        packed_batch = pack_batch(batch, pad_id=0, capacity=16)
        packed = scored_tokens(model, packed_batch)
        full = batch_logprobs(model, batch)
    assert len(packed_batch) < len(batch)  # several samples per row
    assert packed_batch.kept is not None
    assert int((packed_batch.kept > 0).sum()) == int((batch.kept > 0).sum())
    assert sorted(packed_batch.kept[packed_batch.kept > 0].tolist()) == sorted(batch.kept[batch.kept > 0].tolist())
    m, pm = batch.loss_mask > 0, packed_batch.loss_mask > 0
    assert torch.allclose(padded.logprobs[m].sort().values, packed.logprobs[pm].sort().values, atol=1e-6)
    assert padded.support_mismatch_tokens == packed.support_mismatch_tokens
    k1 = batch.kept == 1
    assert torch.all(padded.logprobs[k1] <= 0) and bool((padded.logprobs[batch.kept > 0] >= full[batch.kept > 0]).all())
    # the 49-sized support is the whole vocabulary: exactly the untruncated value
    assert torch.equal(padded.logprobs[0, 4], full[0, 4])
    assert torch.equal(padded.logprobs[batch.kept == 0], full[batch.kept == 0])


def test_untruncated_batches_take_todays_path_bit_for_bit():
    model = _tiny_model(4)
    batch = make_batch(_table(), pad_id=0, keep_sampling_mask=False)
    with torch.no_grad():
        assert torch.equal(train_logprobs(model, batch), batch_logprobs(model, batch))
        packed = pack_batch(batch, pad_id=0)
        assert torch.equal(train_logprobs(model, packed), packed_logprobs(model, packed))
        with_entropy = scored_tokens(model, batch, entropy=True)
    assert torch.equal(with_entropy.logprobs, batch_logprobs(model, batch))
    assert with_entropy.entropy is not None and bool((with_entropy.entropy > 0).all())


def test_a_version_2_shard_still_reads_and_trains(tmp_path):
    """A shard written with the version-2 schema (no completion_kept) reads, batches and scores as full vocabulary."""
    v2 = pa.schema(
        [f for f in rollouts.ROLLOUT_SCHEMA if f.name != "completion_kept"],
        metadata={b"rollflow.schema_version": b"2"},
    )
    table = _table().drop_columns(["completion_kept"]).cast(v2)
    fs, root = get_fs(str(tmp_path / "run"))
    files = {"part-00000.arrow": rollouts._ipc_bytes(table)}
    commit_dir(fs, rollouts.step_path(root, 1), files, {"step": 1, "rows": table.num_rows, "schema_version": 2})
    back, manifest = rollouts.read_step(fs, root, 1)
    assert manifest["schema_version"] == 2 and "completion_kept" not in back.column_names
    batch = make_batch(back, pad_id=0)
    assert batch.kept is None
    model = _tiny_model(5)
    with torch.no_grad():
        assert torch.equal(train_logprobs(model, batch), batch_logprobs(model, batch))
    from engines.trainer.layout import Layout
    from engines.trainer.mismatch import PolicyHistory

    history = PolicyHistory(model, keep=1)
    history.add(0, model)
    assert history.mismatch_kl(batch, Layout(2)).tokens == int(batch.loss_mask.sum())
