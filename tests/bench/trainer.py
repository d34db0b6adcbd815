"""Benchmark 4: trainer tokens/s with sequence packing against padded batches, on the same rollouts.

Two `RLTrainer`s built from a finished benchmark run's trainer config (same weights, packing off/on)
train on that run's committed rollout steps in turn; each step's batch is one repeat.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.bench.harness import Stats, Workspace, ratio_stats, table

TITLE = "4. Trainer: sequence packing vs padding"


def _trainer(run: Path, packing: bool):
    from config.process import TrainerProcessConfig
    from engines.trainer.rl import RLTrainer
    from storage.fs import read_json

    cfg = TrainerProcessConfig.model_validate(read_json(str(run / "config" / "trainer.json")))
    cfg.trainer = cfg.trainer.model_copy(update={"packing": packing, "measure_mismatch": False})
    return RLTrainer(cfg)


def measure(run: Path) -> dict:
    from engines.trainer.batch import make_batch, pack_batch, sample_lengths
    from engines.trainer.layout import Layout
    from engines.trainer.mismatch import PolicyHistory
    from storage import rollouts
    from storage.fs import get_fs

    padded, packed = _trainer(run, False), _trainer(run, True)
    history = PolicyHistory(padded.model, keep=8)
    fs, root = get_fs(str(run))
    times: dict[str, list[float]] = {"padded": [], "packed": [], "kl padded": [], "kl packed": [], "make_batch": []}
    tokens, slots_padded, slots_packed = [], [], []
    losses: list[tuple[float, float]] = []
    for step in rollouts.committed_rollout_steps(fs, root):
        table_ = rollouts.read_step(fs, root, step)[0]
        t0 = time.perf_counter()
        batch = make_batch(table_, padded.tok.pad_id)
        times["make_batch"].append(time.perf_counter() - t0)
        for v in set(batch.versions.tolist()):  # weights for every sampling version, so all rows are scored
            history.add_state(v, padded.model.state_dict())
        for name, pad in (("kl padded", None), ("kl packed", padded.tok.pad_id)):
            t0 = time.perf_counter()
            history.mismatch_kl(batch, Layout(padded.tcfg.micro_batch_size, pad, packing=pad is not None))
            times[name].append(time.perf_counter() - t0)
        stats: dict[str, dict] = {}
        for name, trainer in (("padded", padded), ("packed", packed)):
            t0 = time.perf_counter()
            stats[name] = trainer.optimize(batch)
            times[name].append(time.perf_counter() - t0)
        losses.append((stats["padded"]["loss"], stats["packed"]["loss"]))
        tokens.append(sum(sample_lengths(batch)))
        slots_padded.append(batch.input_ids.numel())
        slots_packed.append(pack_batch(batch, padded.tok.pad_id).input_ids.numel())
    return {
        "times": times,
        "tokens": tokens,
        "slots": (slots_padded, slots_packed),
        "loss_delta_first_step": abs(losses[0][0] - losses[0][1]),
        "micro_batch_size": padded.tcfg.micro_batch_size,
    }


def report(m: dict) -> str:
    tok = m["tokens"]
    rates = {k: Stats([n / t for n, t in zip(tok, v, strict=True)]) for k, v in m["times"].items()}
    t = m["times"]
    speedup = ratio_stats(t["padded"], t["packed"])
    breakdown = [
        ["`make_batch` (Arrow rows to tensors)", Stats(t["make_batch"]).fmt(unit=" s"), "same", "-"],
        [
            "`mismatch_kl` (a forward per sampling policy)",
            Stats(t["kl padded"]).fmt(unit=" s"),
            Stats(t["kl packed"]).fmt(unit=" s"),
            ratio_stats(t["kl padded"], t["kl packed"]).fmt() + "x",
        ],
        [
            "`optimize` (forward, backward, AdamW)",
            Stats(t["padded"]).fmt(unit=" s"),
            Stats(t["packed"]).fmt(unit=" s"),
            speedup.fmt() + "x",
        ],
    ]
    pad_p, pad_k = m["slots"]
    rows = [
        ["padded (baseline)", rates["padded"].fmt(), Stats([t / s for t, s in zip(tok, pad_p, strict=True)]).fmt(2)],
        ["packed", rates["packed"].fmt(), Stats([t / s for t, s in zip(tok, pad_k, strict=True)]).fmt(2)],
    ]
    return "\n\n".join(
        [
            table(["layout", "training tokens/s", "real tokens / tensor slots"], rows),
            f"Speedup of packing (padded time / packed time, per step): **{speedup.fmt()}x** over "
            f"{len(tok)} steps. The first step's loss differs by {m['loss_delta_first_step']:.1e} between "
            "the two layouts (same weights, same samples: it should be ~0).",
            "Where a trainer step's time goes (per step; publishing the weights is in benchmark 3):",
            table(["part of the step", "padded", "packed", "speedup"], breakdown),
        ]
    )


DEFINITIONS = """\
Rollouts: every committed step of one benchmark-1 run (async_level 1). Training tokens/s = prompt +
completion tokens of the step's samples / `RLTrainer.optimize` time (forward, backward and AdamW step;
`mismatch_kl` off, the same in both). Padded: one row per sample, right-padded to the step's longest,
`micro_batch_size` rows per forward. Packed (`trainer.packing = true`): samples first-fit into rows as
long as the step's longest sample, positions restarting per sample, block-diagonal causal mask, the same
`micro_batch_size` rows per forward. Both start from the run's final weights; threads: 1.
"""


def run(ws: Workspace) -> str:
    return DEFINITIONS + "\n" + report(measure(ws.any_run()))
