"""Benchmark 4: trainer tokens/s with sequence packing and with prefix sharing against padded batches.

Three `RLTrainer`s built from a finished benchmark run's trainer config (same weights; padded, packed, shared
prompts) train on that run's committed rollout steps in turn; each step's batch is one repeat.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.bench.harness import Stats, Workspace, ratio_stats, table

TITLE = "4. Trainer: sequence packing and prefix sharing vs padding"

LAYOUTS = {  # name -> (trainer.packing, trainer.prefix_sharing)
    "padded": (False, False),
    "packed": (True, False),
    "shared prompts": (False, True),
}


def _trainer(run: Path, packing: bool, sharing: bool):
    from config.process import TrainerProcessConfig
    from engines.trainer.rl import RLTrainer
    from storage.fs import read_json

    cfg = TrainerProcessConfig.model_validate(read_json(str(run / "config" / "trainer.json")))
    update = {"packing": packing, "prefix_sharing": sharing, "measure_mismatch": False}
    cfg.trainer = cfg.trainer.model_copy(update=update)
    return RLTrainer(cfg)


def _slots(mbs: list) -> int:
    return sum(mb.input_ids.numel() for mb in mbs)


def measure(run: Path) -> dict:
    from engines.trainer.batch import make_batch, sample_lengths
    from engines.trainer.layout import forward_tokens
    from engines.trainer.mismatch import PolicyHistory
    from storage import rollouts
    from storage.fs import get_fs

    trainers = {name: _trainer(run, *flags) for name, flags in LAYOUTS.items()}
    base = trainers["padded"]
    history = PolicyHistory(base.model, keep=8)
    fs, root = get_fs(str(run))
    times: dict[str, list[float]] = {"make_batch": [], **{k: [] for n in LAYOUTS for k in (n, f"kl {n}")}}
    tokens: list[int] = []
    slots: dict[str, list[int]] = {n: [] for n in LAYOUTS}
    forwarded: dict[str, list[int]] = {n: [] for n in LAYOUTS}
    losses: list[dict[str, float]] = []
    for step in rollouts.committed_rollout_steps(fs, root):
        table_ = rollouts.read_step(fs, root, step)[0]
        t0 = time.perf_counter()
        batch = make_batch(table_, base.tok.pad_id)
        times["make_batch"].append(time.perf_counter() - t0)
        for v in set(batch.versions.tolist()):  # weights for every sampling version, so all rows are scored
            history.add_state(v, base.model.state_dict())
        step_losses = {}
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            history.mismatch_kl(batch, trainer.layout)
            times[f"kl {name}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            step_losses[name] = trainer.optimize(batch)["loss"]
            times[name].append(time.perf_counter() - t0)
            mbs = trainer.layout.split(batch)
            slots[name].append(_slots(mbs))
            forwarded[name].append(sum(forward_tokens(mb) for mb in mbs))
        losses.append(step_losses)
        tokens.append(sum(sample_lengths(batch)))
    first = losses[0]
    return {
        "times": times,
        "tokens": tokens,
        "slots": slots,
        "forwarded": forwarded,
        "loss_delta_first_step": max(abs(first[n] - first["padded"]) for n in LAYOUTS),
        "micro_batch_size": base.tcfg.micro_batch_size,
    }


def report(m: dict) -> str:
    tok, t = m["tokens"], m["times"]
    rates = {n: Stats([k / s for k, s in zip(tok, t[n], strict=True)]) for n in LAYOUTS}
    rows = [
        [
            name + (" (baseline)" if name == "padded" else ""),
            rates[name].fmt(),
            Stats([f / s for f, s in zip(m["forwarded"][name], tok, strict=True)]).fmt(2),
            Stats([f / s for f, s in zip(m["forwarded"][name], m["slots"][name], strict=True)]).fmt(2),
            ratio_stats(t["padded"], t[name]).fmt() + "x",
        ]
        for name in LAYOUTS
    ]
    breakdown = [["`make_batch` (Arrow rows to tensors)", Stats(t["make_batch"]).fmt(unit=" s"), "same", "same"]]
    for part, key in (("`mismatch_kl` (a forward per sampling policy)", "kl {}"), ("`optimize`", "{}")):
        breakdown.append([part] + [Stats(t[key.format(n)]).fmt(unit=" s") for n in LAYOUTS])
    shared = ratio_stats(t["padded"], t["shared prompts"])
    return "\n\n".join(
        [
            table(
                ["layout", "sample tokens/s", "tokens forwarded / sample tokens", "of tensor slots", "speedup"], rows
            ),
            f"Speedup of prefix sharing (padded time / shared time, per step): **{shared.fmt()}x** over {len(tok)} "
            f"steps. The first step's loss differs by at most {m['loss_delta_first_step']:.1e} between the layouts "
            "(same weights, same samples: it should be ~0).",
            "Where a trainer step's time goes (per step; publishing the weights is in benchmark 3):",
            table(["part of the step", *LAYOUTS], breakdown),
        ]
    )


DEFINITIONS = """\
Rollouts: every committed step of one benchmark-1 run (async_level 1). Sample tokens/s = prompt + completion
tokens of the step's samples / `RLTrainer.optimize` time (forward, backward and AdamW step; `mismatch_kl` off,
the same in all). Padded: one row per sample, right-padded, `micro_batch_size` rows per forward (shortest first,
each cut to its longest). Packed (`trainer.packing = true`): samples first-fit into rows as long as the step's
longest sample, positions restarting per sample, block-diagonal causal mask. Shared prompts
(`trainer.prefix_sharing = true`, the default): a group's prompt once per row, its completions after it, each
attending to the prompt and itself. Packed and shared forwards hold at most `micro_batch_size` x the longest
sample's tokens. All start from the run's final weights; threads: 1.
"""


def run(ws: Workspace) -> str:
    return DEFINITIONS + "\n" + report(measure(ws.any_run()))
