"""Qwen3-MoE block: parity with transformers' Qwen3MoeForCausalLM, routing record and router replay."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from config.model import ModelConfig
from engines.models.decoder import CausalLM, token_logprobs
from engines.models.moe import Routing

VOCAB = 61
CFG = ModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_seq_len=32,
    qk_norm=True,
    tie_word_embeddings=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
)


def hf_model(norm_topk_prob: bool, **extra):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        moe_intermediate_size=CFG.moe_intermediate_size,
        num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads,
        num_key_value_heads=CFG.num_kv_heads,
        head_dim=CFG.hidden_size // CFG.num_heads,
        num_experts=CFG.num_experts,
        num_experts_per_tok=CFG.num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        rms_norm_eps=CFG.rms_norm_eps,
        tie_word_embeddings=False,
        initializer_range=0.2,  # decisive routing: top-k is not a near-tie everywhere
        **extra,
    )
    return Qwen3MoeForCausalLM(config).eval()


def ours_from(hf, tmp_path, norm_topk_prob: bool, **extra) -> CausalLM:
    hf.save_pretrained(tmp_path)
    model = CausalLM(CFG.model_copy(update={"norm_topk_prob": norm_topk_prob, **extra}), VOCAB).eval()
    model.load_published(load_file(tmp_path / "model.safetensors"))  # HF's on-disk names, strictly checked
    return model


def ids(batch: int = 3, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logprobs_match_transformers(tmp_path, norm_topk_prob):
    hf = hf_model(norm_topk_prob)
    ours = ours_from(hf, tmp_path, norm_topk_prob)
    x = ids()
    with torch.no_grad():
        want = token_logprobs(hf(x).logits[:, :-1], x[:, 1:], 1.0)
        got = token_logprobs(ours(x)[:, :-1], x[:, 1:], 1.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())


def test_dense_layers_among_sparse_ones_match_and_are_left_out_of_the_payload(tmp_path):
    hf = hf_model(True, mlp_only_layers=[0])
    ours = ours_from(hf, tmp_path, True, mlp_only_layers=[0])
    x, rec = ids(), Routing()
    with torch.no_grad():
        want = token_logprobs(hf(x).logits[:, :-1], x[:, 1:], 1.0)
        got = token_logprobs(ours(x, routing=rec)[:, :-1], x[:, 1:], 1.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert rec.stacked().shape == (3, 12, 1, CFG.num_experts_per_tok)  # one MoE layer of two


def test_state_dict_names_are_hf_on_disk_names():
    keys = set(CausalLM(CFG, VOCAB).state_dict())
    assert "model.layers.1.mlp.gate.weight" in keys
    assert {f"model.layers.0.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert not any(k.startswith("model.layers.0.mlp.gate_proj") for k in keys)


def test_dense_config_has_no_experts():
    keys = set(CausalLM(CFG.model_copy(update={"num_experts": 0}), VOCAB).state_dict())
    assert "model.layers.0.mlp.gate_proj.weight" in keys and not any("experts" in k for k in keys)


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(CFG, VOCAB).eval()


def test_record_shape_and_own_replay_is_identical():
    model, x = _model(), ids()
    rec = Routing()
    with torch.no_grad():
        base = model(x, routing=rec)
        routes = rec.stacked()
        assert routes.shape == (3, 12, CFG.num_layers, CFG.num_experts_per_tok)
        assert routes.min() >= 0 and routes.max() < CFG.num_experts
        replayed = model(x, routing=Routing(replay=routes))
    assert torch.equal(base, replayed)
    # -1 means "route afresh": identical too
    with torch.no_grad():
        assert torch.equal(base, model(x, routing=Routing(replay=torch.full_like(routes, -1))))


def test_replaying_other_choices_changes_logprobs_and_trains_the_gate():
    model, x = _model(), ids()
    rec = Routing()
    with torch.no_grad():
        base = token_logprobs(model(x, routing=rec)[:, :-1], x[:, 1:], 1.0)
    other = (rec.stacked() + 1) % CFG.num_experts  # a different expert in every slot
    fresh = Routing(replay=other)
    logp = token_logprobs(model(x, routing=fresh)[:, :-1], x[:, 1:], 1.0)
    assert (logp.detach() - base).abs().max() > 1e-3
    # the model's own choice is still recorded while replaying
    assert torch.equal(fresh.stacked(), rec.stacked())
    logp.sum().backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_generation_records_the_routes_a_full_forward_takes():
    """The payload covers prompt + completion - 1 positions and equals the trainer's own routing of the
    same sequence; replaying it reproduces the sampler's logprobs (fp32 both sides)."""
    from engines.inference.embedded.generate import generate

    model = _model(3)
    prompts = [[1, 5, 7, 9], [1, 5, 7, 9], [1, 4, 2]]
    outs = generate(
        model,
        prompts,
        max_new_tokens=[6, 6, 6],
        temperatures=[1.0] * 3,
        eos_id=0,
        pad_id=60,
        seeds=[1, 2, 3],
        record_routes=True,
    )
    for p, c in zip(prompts, outs, strict=True):
        assert c.routed_experts is not None
        seq = p + c.token_ids
        assert c.routed_experts.shape == (len(seq) - 1, CFG.num_layers, CFG.num_experts_per_tok)
        rec = Routing()
        x = torch.tensor([seq[:-1]])
        with torch.no_grad():
            model(x, routing=rec)
            assert torch.equal(rec.stacked()[0].to(torch.int16), c.routed_experts)
            replay = Routing(replay=c.routed_experts.long()[None])
            logits = model(x, routing=replay)[0, len(p) - 1 :]
        logp = token_logprobs(logits[None], torch.tensor([c.token_ids]), 1.0)[0]
        assert torch.allclose(logp, torch.tensor(c.logprobs), atol=1e-5)


def test_dense_generation_records_nothing():
    from engines.inference.embedded.generate import generate

    torch.manual_seed(0)
    model = CausalLM(CFG.model_copy(update={"num_experts": 0}), VOCAB).eval()
    (out,) = generate(
        model, [[1, 2]], max_new_tokens=[3], temperatures=[1.0], eos_id=0, pad_id=60, seeds=[1], record_routes=True
    )
    assert out.routed_experts is None


def test_router_replay_turns_on_routed_experts_and_refuses_an_explicit_off():
    from config.loader import load_run_config

    profile = "profiles/tiny-moe-cpu.toml"
    cfg = load_run_config([profile])
    assert cfg.trainer.enable_router_replay and cfg.inference.enable_return_routed_experts
    assert cfg.model.num_experts == 4 and cfg.model.num_experts_per_tok == 2
    with pytest.raises(ValueError, match="inference.enable_return_routed_experts"):
        load_run_config([profile], [("inference.enable_return_routed_experts", "false")])
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        load_run_config([profile], [("model.num_experts_per_tok", "5")])
    with pytest.raises(ValueError, match="dtype"):
        load_run_config([profile], [("inference.dtype", "float16")])


def test_bf16_engine_model_samples_with_its_own_numbers():
    """inference.dtype = bfloat16: the engine's copy runs in bf16 end to end (KV cache included), and its
    logprobs differ from the fp32 trainer's by rounding only."""
    from engines.inference.embedded.generate import generate

    model = _model(4)
    sampler = _model(4).to(torch.bfloat16)
    (out,) = generate(
        sampler, [[1, 5, 7]], max_new_tokens=[8], temperatures=[1.0], eos_id=0, pad_id=60, seeds=[5], record_routes=True
    )
    assert out.routed_experts is not None and len(out.token_ids) > 0
    seq = torch.tensor([[1, 5, 7, *out.token_ids]])
    with torch.no_grad():
        fp32 = token_logprobs(model(seq)[:, 2:-1], seq[:, 3:], 1.0)[0]
    diff = (fp32 - torch.tensor(out.logprobs)).abs().max()
    # measured 1.6e-3 over 8 tokens: bf16 rounding (8-bit mantissa, 4e-3 relative); 2e-2 leaves room for other kernels
    assert 0 < diff < 2e-2


def _rollout_table(model: CausalLM, sampler: CausalLM):
    """A rollout step as the orchestrator writes it, sampled by `sampler` with routing recorded."""
    from engines.inference.embedded.generate import generate
    from storage.rollouts import RolloutRow, to_table

    prompts = [[1, 5, 7, 9], [1, 5, 7, 9], [1, 4, 2], [1, 3, 3, 8, 2, 6]]
    outs = generate(
        sampler, prompts, max_new_tokens=[7] * 4, temperatures=[1.0] * 4, eos_id=0, pad_id=60, seeds=[1, 2, 3, 4],
        record_routes=True,
    )  # fmt: skip
    rows = [
        RolloutRow(
            run_id="r",
            step=1,
            sample_id=f"s{i}",
            group_id="g",
            env="e",
            policy_version=0,
            policy_version_end=0,
            prompt_ids=p,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            reward=0.0,
            advantage=1.0,
            temperature=1.0,
            finish_reason=c.finish_reason,
            prompt_text="",
            completion_text="",
            routed_experts=c.routed_experts.tolist() if c.routed_experts is not None else None,
        )  # fmt: skip
        for i, (p, c) in enumerate(zip(prompts, outs, strict=True))
    ]
    return to_table(rows)


def test_trainer_replays_the_committed_payload_padded_and_packed():
    from engines.trainer.batch import make_batch, pack_batch
    from engines.trainer.common import expert_disagreement, routing_for, train_logprobs
    from engines.trainer.layout import Layout
    from engines.trainer.mismatch import PolicyHistory

    model = _model(5)
    sampler = _model(5)
    with torch.no_grad():  # a router nudged so that the sampler picks other experts for some tokens, not all
        g = torch.Generator().manual_seed(0)
        for name, p in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.005 * torch.randn(p.shape, generator=g))
    batch = make_batch(_rollout_table(model, sampler.to(torch.bfloat16)), pad_id=60)
    assert batch.routes is not None and batch.routes.shape[:2] == batch.input_ids.shape
    packed = pack_batch(batch, pad_id=60)
    sums = {}
    with torch.no_grad():
        for replay in (True, False):
            a = train_logprobs(model, batch, routing_for(batch, replay))
            b = train_logprobs(model, packed, routing_for(packed, replay))
            sums[replay] = (a * batch.loss_mask).sum()
            assert torch.allclose(sums[replay], (b * packed.loss_mask).sum(), atol=1e-4)  # measured <= 7.6e-6
        # measured 4.0e-3: a packed layout that dropped the payload would fail the 1e-4 above
        assert abs(float(sums[True] - sums[False])) > 1e-3
        own = routing_for(batch, replay=False)
        train_logprobs(model, batch, own)
        differ, scored = expert_disagreement(own, batch)
        # measured 14 of 24 (fixed seeds): the nudge makes some disagree, and it is too small to move them all
        assert scored == float(batch.loss_mask.sum()) and 0 < differ < scored
    history = PolicyHistory(model, keep=1)
    history.add(0, model)
    on, off = (
        history.mismatch_kl(batch, Layout(8), replay=True),
        history.mismatch_kl(batch, Layout(8, 60, packing=True)),
    )
    assert on.tokens == off.tokens == int(batch.loss_mask.sum())
    assert on.expert_mismatch == off.expert_mismatch == differ / scored
    # measured 1.3e-7 on, 2.0e-6 off: replaying the sampler's experts removes most of the mismatch
    assert on.kl is not None and off.kl is not None and 4 * on.kl < off.kl
