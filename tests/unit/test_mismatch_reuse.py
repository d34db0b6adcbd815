"""mismatch_kl reuses the trainer's forward: the real `RLTrainer` (a tiny model, version 0 published to a tmp run
directory) measures a batch whose rows come from the current and two older policies; with every stale row
rescored (mismatch_sample_fraction = 1) the figure must equal the history-only computation of every row
(`PolicyHistory.mismatch_kl`, the old path) to float precision, in each layout the loss uses; the stale sample
is deterministic per step and stands for the rows it leaves out."""

from __future__ import annotations

import torch

from config.loss import MaskedISLoss, PPOClipLoss
from config.model import ModelConfig
from config.process import ComponentPaths, TrainerProcessConfig
from config.storage import StorageConfig
from config.tracking import TrackingConfig
from config.trainer import CheckpointConfig, TrainerConfig
from engines.models import modeldir
from engines.trainer.batch import Batch
from engines.trainer.common import train_logprobs
from engines.trainer.mismatch import stale_sample
from engines.trainer.rl import RLTrainer
from storage import weights
from storage.fs import Storage

CURRENT = 4  # the trainer's version before the update; rows of versions 2 and 3 are stale


def published_trainer(
    tmp_path, model_cfg: ModelConfig, trainer: TrainerConfig, max_off_policy_steps: int, scale: float = 1.0
) -> RLTrainer:
    """The real `RLTrainer` of a run directory at `tmp_path` whose version 0 is a fresh `model_cfg` model, its
    matrices multiplied by `scale` before publishing."""
    loaded = modeldir.load(model_cfg, pretrained=False)
    with torch.no_grad():
        for p in loaded.model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    fs, root = Storage(StorageConfig()).open(str(tmp_path))
    weights.Publisher(fs, root).publish(0, loaded.model.publishable_state_dict(), loaded.publication_files())
    cfg = TrainerProcessConfig(
        run=ComponentPaths(output_dir=str(tmp_path), run_id="t", storage=StorageConfig()),
        model=model_cfg,
        trainer=trainer,
        tracking=TrackingConfig(),
        mlflow_run_id=None,
        checkpoint=CheckpointConfig(),
        resume_step=None,
        seed=0,
        max_steps=10,
        max_off_policy_steps=max_off_policy_steps,
    )
    return RLTrainer(cfg)


def _trainer(tmp_path, **trainer) -> RLTrainer:
    model_cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    t = published_trainer(
        tmp_path, model_cfg, TrainerConfig(micro_batch_size=5, mismatch_sample_fraction=1.0, **trainer), 2
    )
    g = torch.Generator().manual_seed(1)
    for version in (2, 3, CURRENT):  # each older policy a small step away from the next
        t.history.add(version, t.model)
        if version < CURRENT:
            with torch.no_grad():
                for p in t.model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
    t.version = CURRENT
    return t


def _batch(t: RLTrainer, rows: int = 23, length: int = 14) -> Batch:
    """Varied lengths; versions 2, 3, 4 and an in-flight row; sampler logprobs = the sampling policy's plus
    noise of the size a real engine shows (log ratios ~1e-3)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, t.tok.vocab_size, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    for i, n in enumerate(torch.randint(6, length + 1, (rows,), generator=g).tolist()):
        mask[i, 3 : n - 1] = 1.0
        ids[i, n:] = t.tok.pad_id
    versions = torch.tensor([2, 3, CURRENT, CURRENT, CURRENT] * 4 + [CURRENT, 3, 2])
    ends = versions.clone()
    ends[3] = CURRENT + 1  # drawn across an update: no single policy, left out
    advantages = torch.randn(rows, generator=g)
    batch = Batch(ids, ids[:, 1:], mask, torch.zeros_like(mask), advantages, torch.ones(rows), versions, ends)
    for v, state in t.history.states.items():
        t.history.scratch.load_state_dict(state)
        with torch.no_grad():
            lp = train_logprobs(t.history.scratch, batch)
        rows_v = versions == v
        batch.sampler_logprobs[rows_v] = ((lp + 1e-3 * torch.randn(lp.shape, generator=g)) * mask)[rows_v]
    return batch


def _reused_vs_full(t: RLTrainer, batch: Batch) -> tuple[float, float, int, int]:
    """(the old full figure, the new one, tokens the history scored, tokens the loss's forward added), the
    steps in `RLTrainer.step`'s order: measure, the zero-advantage filter (every 4th row here), optimize."""
    full = t.history.mismatch_kl(batch, t.layout)
    ids = [f"s{i}" for i in range(len(batch))]
    zero = torch.arange(len(batch)) % 4 == 0
    sums = t.measure_mismatch(batch, ids, zero, step=CURRENT + 1)
    assert sums is not None and batch.measured is not None
    history_tokens = sums.sums[1]
    if t.tcfg.loss.zero_advantage == "filter":
        batch.loss_mask[zero] = 0.0
    t.optimize(batch, sums)  # the loss's first forward (or the proximal scoring) adds the current policy's rows
    new = sums.result()
    assert full.kl is not None and new.kl is not None
    assert new.tokens == full.tokens
    return full.kl, new.kl, int(history_tokens), int(batch.measured.sum())


def test_reused_forward_equals_full_history_computation(tmp_path) -> None:
    cases: list[tuple[bool, dict]] = [
        (False, {}),
        (True, {"loss": MaskedISLoss(zero_advantage="filter")}),  # filtered rows: the history's
        (False, {"mini_batches": 2, "loss": MaskedISLoss(zero_advantage="filter")}),  # 2nd mini-batch: history
        (True, {"mini_batches": 2, "loss": PPOClipLoss(old_policy="proximal")}),  # all from the proximal scoring
    ]
    for i, (packing, trainer) in enumerate(cases):
        t = _trainer(tmp_path / str(i), packing=packing, **trainer)
        full, new, history_tokens, reused_tokens = _reused_vs_full(t, _batch(t))
        assert reused_tokens > 0 and history_tokens > 0  # both paths took part
        assert full > 1e-7  # a figure float noise cannot fake
        # measured: |new - full| = 0.0 in every case (the same float32 logprobs, summed in float64); a bound at
        # float32's resolution. A wrong policy or mask moves it by orders of magnitude (the neighbouring
        # policies' KL to the sampler is ~1e-3, the figure ~5e-7)
        assert abs(new - full) <= 1e-6 * full, (i, full, new)


def test_stale_sample_is_deterministic_and_weighted() -> None:
    rows = torch.arange(3, 43)
    ids = [f"id{i}" for i in range(50)]
    picked, weight = stale_sample(ids, rows, 0.25, step=7)
    assert len(picked) == 10 and weight == 4.0
    assert torch.equal(picked, stale_sample(ids, rows, 0.25, step=7)[0])
    assert not torch.equal(picked, stale_sample(ids, rows, 0.25, step=8)[0])  # another subset next step
    assert set(picked.tolist()) <= set(rows.tolist())
    assert stale_sample(ids, rows, 1.0, step=7) == (rows, 1.0)
