"""engines/models/decoder.py + engines/inference/embedded/generate.py: cached sampling logprobs equal the trainer's
full forward,
in-flight weight swaps are recorded per sequence, and HF Llama/Qwen3 checkpoints load with equal logits."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa
import pytest
import torch

from config.model import ModelConfig
from engines.inference.embedded.generate import generate
from engines.models.decoder import CausalLM, token_logprobs
from engines.models.tokenizer import CharTokenizer
from engines.trainer.batch import make_batch
from engines.trainer.common import batch_logprobs

TOK = CharTokenizer()
CFG = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, max_seq_len=64, rope_theta=500.0
)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from the near-uniform default init, so positions, masks and every tensor matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model.eval()


def _model(seed: int = 0, cfg: ModelConfig = CFG) -> CausalLM:
    torch.manual_seed(seed)
    return _randomize(CausalLM(cfg, TOK.vocab_size), seed)


def _full_forward_logprobs(model, prompt, completion, temperature) -> torch.Tensor:
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(seq)[:, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor([completion]), temperature)[0]


def test_generate_logprobs_match_full_forward():
    model = _model()
    texts = ["rev:abc=", "sort:helloworld=", "x=", "rev:qwertyuio=", "sort:ba="]
    prompts = [TOK.encode(t) for t in texts]
    temps = [1.0, 0.7, 1.5, 0.3, 1.0]
    max_new = [10, 6, 12, 4, 9]
    out = generate(
        model, prompts, max_new_tokens=max_new, temperatures=temps, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
        seeds=[3, 4, 5, 6, 7],
    )  # fmt: skip
    assert len(out) == len(prompts)
    rows = []
    for p, c, t, m in zip(prompts, out, temps, max_new, strict=True):
        assert 1 <= len(c.token_ids) <= m
        assert len(c.logprobs) == len(c.token_ids)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == TOK.eos_id)
        assert c.finish_reason == "stop" or len(c.token_ids) == m
        assert TOK.eos_id not in c.token_ids[:-1]
        assert c.policy_version == c.policy_version_end == 0
        expected = _full_forward_logprobs(model, p, c.token_ids, t)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)
        rows.append((p, c, t))
    # the trainer's batched, right-padded path (what mismatch_kl measures) agrees too
    table = pa.table(
        {
            "prompt_ids": [p for p, _, _ in rows],
            "completion_ids": [c.token_ids for _, c, _ in rows],
            "completion_logprobs": [c.logprobs for _, c, _ in rows],
            "advantage": [0.0] * len(rows),
            "temperature": [t for _, _, t in rows],
            "policy_version": [0] * len(rows),
            "policy_version_end": [0] * len(rows),
        }
    )
    batch = make_batch(table, TOK.pad_id)
    with torch.no_grad():
        trainer = batch_logprobs(model, batch)
    m = batch.loss_mask.bool()
    torch.testing.assert_close(trainer[m], batch.sampler_logprobs[m], rtol=0, atol=1e-5)
    assert int(m.sum()) == sum(len(c.token_ids) for _, c, _ in rows)


def test_generate_is_deterministic_given_seeds_and_temperature_matters():
    model = _model()
    prompts = [TOK.encode("rev:abcdef=")] * 4

    def sample(temp, seed):
        return generate(
            model, prompts, max_new_tokens=[8] * 4, temperatures=[temp] * 4, eos_id=-1, pad_id=TOK.pad_id,
            seeds=[seed * 10 + k for k in range(4)],
        )  # fmt: skip

    a, b = sample(1.0, 5), sample(1.0, 5)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    cold = sample(0.01, 6)  # near-greedy: every row takes the argmax path
    assert len({tuple(c.token_ids) for c in cold}) == 1
    greedy_first = int(model(torch.tensor([prompts[0]]))[0, -1].argmax())
    assert cold[0].token_ids[0] == greedy_first


def test_in_flight_weight_swap_records_start_and_end_versions():
    model = _model(seed=0)
    v1 = _model(seed=1).publishable_state_dict()
    reference_v0 = _model(seed=0)
    calls, version = 0, 0

    def between_steps() -> int:
        nonlocal calls, version
        calls += 1
        if calls == 5:  # call 1 precedes prefill, calls 2-4 precede decode steps 1-3
            model.load_published(v1)
            version = 1
        return version

    prompts = [TOK.encode("rev:abc="), TOK.encode("sort:zyxw="), TOK.encode("rev:q=")]
    out = generate(
        model, prompts, max_new_tokens=[8, 8, 3], temperatures=[1.0, 0.8, 1.0], eos_id=-1, pad_id=TOK.pad_id,
        seeds=[0, 1, 2], between_steps=between_steps,
    )  # fmt: skip
    long, short = out[:2], out[2]
    for c, p, t in zip(long, prompts, [1.0, 0.8], strict=False):
        assert len(c.token_ids) == 8
        assert c.policy_version == 0 and c.policy_version_end == 1
        assert c.policy_version != c.policy_version_end
        # tokens 0-3 came from the old weights; token 4 from the new ones
        ref = _full_forward_logprobs(reference_v0, p, c.token_ids, t)
        torch.testing.assert_close(torch.tensor(c.logprobs[:4]), ref[:4], rtol=0, atol=1e-5)
        assert not torch.allclose(torch.tensor(c.logprobs[4:]), ref[4:], atol=1e-3)
    # a sequence that finished before the swap never saw version 1
    assert len(short.token_ids) == 3
    assert short.policy_version == short.policy_version_end == 0


def test_load_published_rejects_mismatched_weights():
    model = _model()
    sd = model.publishable_state_dict()
    assert "lm_head.weight" not in sd  # tied: HF convention drops the alias
    model.load_published(sd)
    with pytest.raises(ValueError, match="missing"):
        model.load_published({k: v for k, v in sd.items() if "layers.1." not in k})
    with pytest.raises(ValueError, match="unexpected"):
        model.load_published({**sd, "model.extra.weight": torch.zeros(1)})


def _hf_parity(hf_model, cfg: ModelConfig) -> None:
    _randomize(hf_model, seed=7)
    sd = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    ours = CausalLM(cfg, TOK.vocab_size).eval()
    ours.load_published(sd)  # raises on any missing or unexpected key
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TOK.vocab_size, (2, 24), generator=g)
    with torch.no_grad():
        want = hf_model(input_ids=ids).logits.float()
        got = ours(ids)
    assert want.abs().max() > 1.0  # weights are far from trivial
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _hf_config_kwargs(cfg: ModelConfig) -> dict:
    """The HF config fields our ModelConfig maps to, shared by the Llama and Qwen3 parity tests."""
    return {
        "vocab_size": TOK.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }


def test_llama_checkpoint_loads_with_equal_logits():
    transformers = pytest.importorskip("transformers")
    cfg = CFG.model_copy(update={"rms_norm_eps": 1e-5})
    hf_cfg = transformers.LlamaConfig(**_hf_config_kwargs(cfg), mlp_bias=False)
    _hf_parity(transformers.LlamaForCausalLM(hf_cfg), cfg)


def test_qwen3_checkpoint_loads_with_equal_logits():
    transformers = pytest.importorskip("transformers")
    cfg = CFG.model_copy(update={"qk_norm": True, "rope_theta": 1000.0})
    hf_cfg = transformers.Qwen3Config(**_hf_config_kwargs(cfg), head_dim=cfg.hidden_size // cfg.num_heads)
    hf = transformers.Qwen3ForCausalLM(hf_cfg)
    assert any("q_norm" in k for k in hf.state_dict())
    _hf_parity(hf, cfg)
