"""One trainer process of the parallelism tests: `python [-m torch.distributed.run ...] parallel_worker.py
trainer.json STEPS CHECKPOINT_AT OUT [varied]`. It builds the real `RLTrainer` from `trainer.json` (torchrun's ranks
join a gloo group and shard with FSDP2; one process stays plain), trains on seeded synthetic batches for
the steps after its version (the resumed checkpoint's or 0; `varied`: samples of 5 to 15 tokens, which
packing puts several to a row), checkpoints at CHECKPOINT_AT (0: never), and
rank 0 saves the losses, gradient norms and final full weights to OUT.
"""

from __future__ import annotations

import sys

import torch

from config.process import TrainerProcessConfig
from engines.trainer import checkpoint, distributed, parallel
from engines.trainer.batch import Batch
from engines.trainer.rl import RLTrainer
from storage.fs import read_json


def synthetic_routes(step: int, rows: int, length: int, layers: int, k: int) -> torch.Tensor:
    """Router replay sending every token to experts 0..k-1 (the first expert-parallel rank's): in the first MoE
    layer always (its other experts never get a gradient, so AdamW holds no state for them), in the second
    from step 2 on (its other experts keep AdamW state but get no gradient); -1 (route afresh) elsewhere."""
    routes = torch.full((rows, length, layers, k), -1, dtype=torch.long)
    routes[:, :, 0] = torch.arange(k)
    if step >= 2 and layers > 1:
        routes[:, :, 1] = torch.arange(k)
    return routes


def synthetic_batch(
    step: int, vocab: int, rows: int = 7, length: int = 16, varied: bool = False, routes: tuple | None = None
) -> Batch:
    """The same rows on every rank and process for a given step: ids, completion mask, advantages; with
    `routes` = (MoE layers, k) also the sampler's expert ids to replay."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 2 :] = 1.0
    if varied:  # sample i has lengths[i] tokens, the second half of its targets completion tokens
        lengths = [15, *torch.randint(5, 15, (rows - 1,), generator=g).tolist()]
        mask.zero_()
        for i, n in enumerate(lengths):
            mask[i, n // 2 : n - 1] = 1.0
            ids[i, n:] = 0
    return Batch(
        input_ids=ids,
        targets=ids[:, 1:],
        loss_mask=mask,
        sampler_logprobs=(-torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(rows, length - 1, generator=g))
        * mask,
        advantages=torch.randn(rows, generator=g),
        temperatures=torch.ones(rows),
        versions=torch.full((rows,), step - 1),
        versions_end=torch.full((rows,), step - 1),
        routes=None if routes is None else synthetic_routes(step, rows, length, *routes),
    )


def main(config: str, steps: int, checkpoint_at: int, out: str, varied: bool = False) -> None:
    trainer = RLTrainer(TrainerProcessConfig.model_validate(read_json(config)))
    d = trainer.dist
    losses, norms = [], []
    m = trainer.model.cfg
    routes = (m.num_layers, m.num_experts_per_tok) if trainer.tcfg.enable_router_replay else None
    for step in range(trainer.version + 1, steps + 1):
        batch = synthetic_batch(step, trainer.model.vocab_size, varied=varied, routes=routes)
        stats = trainer.optimize(batch)  # each rank trains on its share of the rows
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        if step == checkpoint_at:
            checkpoint.save(trainer.fs, trainer.root, step, trainer.state, d)
    weights = parallel.full_state_dict(trainer.model, d)
    if d.is_main:
        torch.save({"losses": losses, "grad_norms": norms, "weights": weights, "world": d.world}, out)
    distributed.shutdown(d)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["varied"])
