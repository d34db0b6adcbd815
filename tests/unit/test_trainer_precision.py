"""trainer.compute_dtype: the real `RLTrainer` (the tiny-cpu model shape, its matrices scaled 3x, version 0 published
to a tmp run directory) measures mismatch_kl on completions the embedded engine sampled from the same weights in
float32 and in bfloat16 (inference.dtype), with its own forwards in float32 and in bfloat16 (`bf16_parameters`).
Its rows are the current policy's, so the loss's own forward scores them: the path every async step takes."""

from __future__ import annotations

import copy

import pytest
import torch

from config.model import ModelConfig
from config.trainer import TrainerConfig
from engines.inference.embedded.generate import generate
from engines.models import modeldir
from engines.trainer.batch import make_batch
from engines.trainer.common import bf16_parameters
from engines.trainer.rl import RLTrainer
from storage.rollouts import RolloutRow, to_table
from tests.unit.test_mismatch_reuse import published_trainer
from tests.unit.test_models_hf import make_dir


def _trainer(tmp_path, compute_dtype: str) -> RLTrainer:
    trainer = TrainerConfig(compute_dtype=compute_dtype, micro_batch_size=16, mismatch_sample_fraction=1.0)  # type: ignore[arg-type]
    # matrices x3: sharper distributions than the near-uniform initial ones, so rounding shows in the KL
    return published_trainer(tmp_path, ModelConfig(), trainer, max_off_policy_steps=1, scale=3.0)


def _sampled(t: RLTrainer, dtype: torch.dtype):
    """A rollout step of 16 completions of 12 tokens, sampled by a `dtype` copy of the trainer's weights."""
    sampler = copy.deepcopy(t.model).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 12, (16,), generator=g).tolist()
    prompts = [torch.randint(4, t.model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    outs = generate(
        sampler, prompts, max_new_tokens=[12] * 16, temperatures=[1.0] * 16, eos_id=t.tok.eos_id,
        pad_id=t.tok.pad_id, seeds=list(range(16)),
    )  # fmt: skip
    rows = [
        RolloutRow(
            run_id="t",
            step=1,
            sample_id=f"s{i}",
            group_id=f"g{i // 4}",
            env="e",
            policy_version=0,
            policy_version_end=0,
            prompt_ids=p,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            reward=float(i % 2),
            advantage=float(i % 2) - 0.5,
            temperature=1.0,
            finish_reason=c.finish_reason,
            prompt_text="",
            completion_text="",
        )  # fmt: skip
        for i, (p, c) in enumerate(zip(prompts, outs, strict=True))
    ]
    return make_batch(to_table(rows), t.tok.pad_id)


def _step(t: RLTrainer, dtype: torch.dtype, stale: bool = False) -> tuple[float, torch.Tensor]:
    """(mismatch_kl, the gradient) of one trainer step on a batch a `dtype` engine sampled; `stale`: the trainer
    one version ahead of the samples, so the history's forward scores them instead of the loss's."""
    t.version = 1 if stale else 0
    batch = _sampled(t, dtype)
    ids = [f"s{i}" for i in range(len(batch))]
    sums = t.measure_mismatch(batch, ids, torch.zeros(len(batch), dtype=torch.bool), step=1)
    assert sums is not None and (batch.measured is None) == stale
    t.optimize(batch, sums)
    kl = sums.result().kl
    assert kl is not None
    grads = [p.grad for p in t.model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    return kl, torch.cat([g.flatten() for g in grads if g is not None])


def test_bf16_trainer_against_bf16_sampler(tmp_path) -> None:
    fp32, fp32_mixed = _trainer(tmp_path / "a", "float32"), _trainer(tmp_path / "b", "float32")
    bf16, bf16_stale = _trainer(tmp_path / "c", "bfloat16"), _trainer(tmp_path / "d", "bfloat16")
    same, _ = _step(fp32, torch.float32)
    mixed, grad = _step(fp32_mixed, torch.bfloat16)
    both, grad_bf16 = _step(bf16, torch.bfloat16)
    history, _ = _step(bf16_stale, torch.bfloat16, stale=True)
    # measured 0, 3.9e-5 and 2.3e-5: bf16 on both sides keeps the mismatch below an fp32 trainer's against the same
    # bf16 sampler (bf16 autocast instead of bf16 parameters measured 7e-5, worse than either)
    assert same < 1e-9
    assert mixed > 1e-5
    assert both < 0.8 * mixed
    assert abs(history - both) <= 1e-6 * both, (history, both)  # the history's forward is in bf16 too
    params = list(bf16.model.parameters())
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in params)
    assert [id(p) for p in params] == [id(p) for g in bf16.optimizer.param_groups for p in g["params"]]
    # the same samples' gradient, computed in bf16: measured cosine 0.99993 to the float32 one
    cosine = torch.nn.functional.cosine_similarity(grad, grad_bf16, dim=0)
    assert float(grad_bf16.abs().max()) > 0 and cosine > 0.9995, float(cosine)


def test_bf16_under_torchrun_is_refused() -> None:
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainerConfig(compute_dtype="bfloat16", parallel={"world_size": 2})


@pytest.mark.parametrize("kind", ["builtin", "llama", "qwen3_moe"])
def test_bf16_parameters_compute_as_a_bf16_copy(tmp_path, kind) -> None:
    """The forward inside `bf16_parameters` is the forward of a bf16 copy (`model.to(bfloat16)`, as the engine
    serves one), bit for bit, for rollflow's model and transformers' (tied embeddings; MoE; RoPE buffers);
    gradients land on the float32 parameters, which come back unchanged, as does the state dict's layout."""
    if kind == "builtin":
        model = modeldir.load(ModelConfig(), pretrained=False).model
    else:
        make_dir(tmp_path, kind)
        model = modeldir.load(ModelConfig(path=str(tmp_path), impl="hf"), pretrained=True).model
    ids = torch.randint(4, model.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    before = [(id(p), p.detach().clone()) for p in model.parameters()]
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = copy.deepcopy(model).to(torch.bfloat16)(ids)
    with bf16_parameters(model):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)
    torch.log_softmax(logits.float(), -1).mean().backward()
    after = list(model.parameters())
    assert [i for i, _ in before] == [id(p) for p in after]
    assert all(torch.equal(p, q) and p.dtype == torch.float32 for (_, q), p in zip(before, after, strict=True))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in after)
    assert list(model.state_dict()) == keys  # non-persistent buffers (RoPE's inv_freq) stay out of it


def test_bf16_with_a_vision_language_model_is_refused_at_load(tmp_path) -> None:
    """transformers' VLM code reads its dtype from `parameters()`, which the bf16 forward swaps out."""
    from config.loader import ConfigError, load_run_config
    from engines.models import tiny_vlm
    from rollflow.checks import check_model

    vlm = tiny_vlm.write(tmp_path / "vlm", seed=0)
    overrides = [("model.path", str(vlm)), ("model.max_seq_len", "512")]
    check_model(load_run_config(["profiles/tiny-cpu.toml"], overrides))  # float32: accepted
    cfg = load_run_config(["profiles/tiny-cpu.toml"], [*overrides, ("trainer.compute_dtype", "bfloat16")])
    with pytest.raises(ConfigError, match="vision-language model: trainer.compute_dtype = 'bfloat16'"):
        check_model(cfg)
