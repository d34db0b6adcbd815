"""What mismatch_kl costs in a trainer step, and the error of its stale-row sample, on a finished run.

`python -m tests.bench.mismatch_cost RUN_DIR [--quick]` replays the run's committed rollout steps through a real
`RLTrainer` built from its trainer.json, each step from the published weights its samples were drawn by
(version s - 1; every sample of an `async_level = 1` run): it times the history's full rescoring (the old
measurement), the new one (`measure_mismatch`, which leaves the current policy's rows to the loss's forward),
the optimizer step (the loss forward/backward; the proximal/reference scoring inside it, none with the
default masked_is loss) and a publication (to a scratch directory: the run is only read). Then, treating
every qualifying row as stale (the worst case: a sample of all of them), the relative error of
`stale_sample`'s token-mean against the full one at a few fractions.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from tests.bench import harness

TITLE = "What mismatch_kl costs in a trainer step (tests/bench/mismatch_cost.py)"
FRACTIONS = (0.1, 0.25, 0.5)


def _trainer(run: str):
    from config.process import TrainerProcessConfig
    from engines.trainer.rl import RLTrainer
    from storage import weights
    from storage.fs import Storage, read_json

    cfg = TrainerProcessConfig.model_validate(read_json(f"{run}/config/trainer.json"))
    cfg = cfg.model_copy(update={"mlflow_run_id": None})
    t = RLTrainer(cfg)
    fs, root = Storage(cfg.run.storage).open(tempfile.mkdtemp(prefix="mismatch-cost-"))
    t.publisher = weights.Publisher(fs, root)  # publications go to a scratch directory
    return t


def _row_kl(t, batch) -> torch.Tensor:
    """[B, 2] float64: each row's k3 sum and token count, scored by the history's scratch (the sampling policy)."""
    from engines.trainer.common import train_logprobs
    from engines.trainer.losses.kl import k3_kl

    # slices in row order at the batch's full width (the trainer's micro_batches sort and trim them)
    slices = [batch.select(slice(i, i + 64)) for i in range(0, len(batch), 64)]
    with torch.no_grad():
        lp = torch.cat([train_logprobs(t.history.scratch, mb) for mb in slices])
    rows = [k3_kl(lp[i : i + 1], batch.sampler_logprobs[i : i + 1], batch.loss_mask[i : i + 1]) for i in range(len(lp))]
    return torch.tensor(rows, dtype=torch.float64)


def _timed(times: dict[str, list[float]], key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    times.setdefault(key, []).append(time.perf_counter() - t0)
    return out


def measure(run: str, steps: int) -> tuple[dict[str, list[float]], dict[float, list[float]]]:
    from engines.trainer import parallel
    from engines.trainer.batch import make_batch
    from engines.trainer.layout import Layout
    from engines.trainer.mismatch import stale_sample
    from storage import rollouts, weights

    t = _trainer(run)
    assert t.history is not None, "the run measured no mismatch (trainer.measure_mismatch = false)"
    times: dict[str, list[float]] = {}
    errors: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    for s in rollouts.committed_rollout_steps(t.fs, t.root)[1 : steps + 1]:  # step 1: version 0, no history yet
        sampler = weights.load(t.fs, weights.version_dir(t.root, s - 1))
        t.model.load_published(sampler)
        t.history.add(s - 1, t.model)
        t.version = s - 1
        table = rollouts.read_step(t.fs, t.root, s)[0]
        batch = make_batch(table, t.tok.pad_id)
        _timed(times, "mismatch, old (history rescores every row)", t.history.mismatch_kl, batch, Layout(64))
        ids, zero = table.column("sample_id").to_pylist(), torch.zeros(len(batch), dtype=torch.bool)
        sums = _timed(times, "mismatch, new (history part)", t.measure_mismatch, batch, ids, zero, s)
        _timed(times, "optimizer step (loss forward/backward)", t.optimize, batch, sums)
        t0 = time.perf_counter()
        t.publish(s, parallel.full_state_dict(t.model, t.dist))
        times.setdefault("publication", []).append(time.perf_counter() - t0)
        per = _row_kl(t, batch)
        rows = torch.nonzero(t.history.qualifying(batch)).flatten()
        full = float(per[rows, 0].sum() / per[rows, 1].sum())
        if not full > 0:  # no mismatch measured on this step (a short run's steps can have none): no relative error
            continue
        for f in FRACTIONS:
            picked, _ = stale_sample(ids, rows, f, s)
            errors[f].append(abs(float(per[picked, 0].sum() / per[picked, 1].sum()) - full) / full)
    return times, errors


def report(times: dict[str, list[float]], errors: dict[float, list[float]]) -> str:
    steps = len(next(iter(times.values())))
    old = sum(statistics.median(v) for k, v in times.items() if "new" not in k)
    lines = [f"{steps} steps, medians (share of an old step's trainer work):"]
    lines += [f"  {k}: {statistics.median(v):.4f} s ({statistics.median(v) / old:.1%})" for k, v in times.items()]
    for f, e in errors.items():
        if not e:
            lines.append(f"  stale sample {f}: no step with a mismatch_kl above 0, no relative error")
            continue
        e = sorted(e)
        lines.append(
            f"  stale sample {f}: relative error of mismatch_kl median {statistics.median(e):.1%}, "
            f"90th percentile {e[int(0.9 * (len(e) - 1))]:.1%}, max {e[-1]:.1%}"
        )
    return "\n".join(lines)


def run(ws: harness.Workspace) -> str:
    """The runner's entry (`python -m tests.bench --every --quick`): the replay on a finished run of the workspace."""
    return report(*measure(str(ws.any_run()), 3 if harness.QUICK else 40))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    print(report(*measure(args[0], 3 if "--quick" in sys.argv else 40)))
