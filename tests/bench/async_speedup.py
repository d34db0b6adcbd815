"""Benchmark 1: async speedup. The same workload (fixed steps, long-tailed completion lengths) with
async_level 0, 1 and 2, interleaved per repeat; the speedup against async_level 0 of the same repeat,
and the ideal speedup from that synchronous run's own generation and training times. Then the default
profile (profiles/tiny-cpu.toml alone) at async_level 0 and 1, with the components' CPU binding off (its
default, `deployment.cpus`, config/cpus.py), interleaved per repeat: its fraction of ideal the same way.
`ROLLFLOW_BENCH_BINDINGS=off,auto python -m tests.bench async --out FILE` adds the `auto` binding to that
comparison (12 runs instead of 6; `make bench` leaves it out to stay within its 20 minutes)."""

from __future__ import annotations

import os
import statistics

from tests.bench.harness import QUICK, ROOT, RunTimes, Stats, Workspace, ratio_stats, repeats, table

TITLE = "1. Async speedup"
LEVELS = (0, 1, 2)
DEFAULT_PROFILE = [ROOT / "profiles/tiny-cpu.toml"]
DEFAULT_STEPS = 3 if QUICK else 16
BINDINGS = tuple(os.environ.get("ROLLFLOW_BENCH_BINDINGS", "off").split(","))


def measure(ws: Workspace, n: int) -> dict[int, list[RunTimes]]:
    runs: dict[int, list[RunTimes]] = {lvl: [] for lvl in LEVELS}
    for r in range(n):
        for lvl in LEVELS:
            runs[lvl].append(RunTimes.read(ws.run(f"async{lvl}-r{r}", async_level=lvl)))
    return runs


def ideal(t: RunTimes) -> float:
    """(gen + train) / max(gen, train) with gen = what the synchronous trainer waits for per step.

    That wait is generation plus the hand-offs around it (weights noticed and loaded, shard committed
    and noticed), all of which async overlaps with training; with `gen_s` alone, measured speedups
    exceed the "ideal".
    """
    return (t.wait + t.train) / max(t.wait, t.train)


def ideal_gen_only(t: RunTimes) -> float:
    """The issue's formula with the orchestrator's generation time alone (no hand-offs)."""
    return (t.gen + t.train) / max(t.gen, t.train)


def report(runs: dict[int, list[RunTimes]]) -> str:
    sync = runs[0]
    ideals = Stats([ideal(t) for t in sync])
    ideals_gen = Stats([ideal_gen_only(t) for t in sync])
    rows = []
    for lvl in LEVELS:
        ts = runs[lvl]
        speedup = ratio_stats([t.wall_per_step for t in sync], [t.wall_per_step for t in ts])
        of_ideal = Stats([s / ideal(t0) for s, t0 in zip(speedup.values, sync, strict=True)])
        rows.append(
            [
                lvl,
                Stats([t.wall_per_step for t in ts]).fmt(unit=" s"),
                Stats([t.gen for t in ts]).fmt(unit=" s"),
                Stats([t.train for t in ts]).fmt(unit=" s"),
                speedup.fmt() + "x",
                "-" if lvl == 0 else of_ideal.fmt(),
                Stats([t.trainer_idle for t in ts]).fmt(2),
                Stats([t.inference_idle for t in ts]).fmt(2),
            ]
        )
    slow_train = ratio_stats([t.train for t in runs[1]], [t.train for t in sync])
    slow_gen = ratio_stats([t.gen for t in runs[1]], [t.gen for t in sync])
    lengths = sorted(x for t in sync for x in t.completion_lengths)
    pct = [lengths[int(q * (len(lengths) - 1))] for q in (0.5, 0.9, 0.99)]
    headers = [
        "async_level",
        "wall / step",
        "gen / step",
        "train / step",
        "speedup vs 0",
        "fraction of ideal",
        "trainer idle",
        "inference idle",
    ]
    return "\n\n".join(
        [
            table(headers, rows),
            f"Ideal speedup from each repeat's synchronous run, (wait + train) / max(wait, train), where wait "
            f"is the synchronous trainer's wait for rollouts (generation plus hand-offs): **{ideals.fmt()}x**; "
            f"with the orchestrator's `gen_s` in place of the wait: {ideals_gen.fmt()}x. Fraction of ideal "
            "uses the first. Target: fraction of ideal >= 0.9.",
            f"Overlap is not free here: with async_level 1, train / step is {slow_train.fmt()}x and gen / step "
            f"{slow_gen.fmt()}x their synchronous values, because generation and training share two cores "
            "(with whatever else runs on the machine); the ideal assumes they do not. Trainer idle near 0 "
            "means the pipeline itself hides generation.",
            f"Completion lengths (tokens, synchronous runs): median {pct[0]}, p90 {pct[1]}, p99 {pct[2]}, "
            f"max {lengths[-1]}, mean {statistics.mean(lengths):.1f}.",
        ]
    )


DEFINITIONS = """\
Workload: `profiles/tiny-cpu.toml` + `tests/bench/bench.toml` (32 prompts x 8 samples per step,
payload lengths long-tailed between 2 and 24 letters, `max_new_tokens = 26`); each run starts from the
same warm-up weights and runs the real inference server, orchestrator and trainer processes, supervised
as the flow does but without Prefect (benchmark 5 measures Prefect). Steady state: step 1 is left out.
- wall / step: (metrics.jsonl `time` of the last step - that of step 1) / (steps - 1).
- gen: the orchestrator's first request to last response for a step (manifest `gen_s`); train: the
  trainer's `train_s + publish_s` (read rollouts excluded, publish included). Medians over steps.
- speedup: async_level 0's wall / step over this level's, within the same repeat.
- trainer idle: the trainer's `wait_s` (waiting for committed rollouts) over wall time.
- inference idle: 1 - (sum of `gen_s`) / wall time; the engine has no work outside a step's generation.
"""


def measure_default(ws: Workspace, n: int) -> dict[str, tuple[list[RunTimes], list[RunTimes]]]:
    """binding -> (async_level 0 runs, async_level 1 runs) of the default profile, interleaved per repeat."""
    runs: dict[str, tuple[list[RunTimes], list[RunTimes]]] = {b: ([], []) for b in BINDINGS}
    for r in range(n):
        for binding in BINDINGS:
            for lvl in (0, 1):
                name = f"default-{binding}-a{lvl}-r{r}"
                over = {"async_level": lvl, "max_steps": DEFAULT_STEPS, "deployment.cpus.mode": binding}
                runs[binding][lvl].append(RunTimes.read(ws.run(name, DEFAULT_PROFILE, **over)))
    return runs


def report_default(runs: dict[str, tuple[list[RunTimes], list[RunTimes]]]) -> str:
    rows = []
    for binding, (sync, overlapped) in runs.items():
        speedup = ratio_stats([t.wall_per_step for t in sync], [t.wall_per_step for t in overlapped])
        ideals = Stats([ideal(t) for t in sync])
        of_ideal = Stats([s / ideal(t0) for s, t0 in zip(speedup.values, sync, strict=True)])
        rows.append(
            [
                binding,
                Stats([t.wall_per_step for t in sync]).fmt(unit=" s"),
                Stats([t.wall_per_step for t in overlapped]).fmt(unit=" s"),
                speedup.fmt() + "x",
                ideals.fmt() + "x",
                f"**{of_ideal.fmt()}**",
            ]
        )
    headers = [
        "deployment.cpus.mode",
        "async 0: wall / step",
        "async 1: wall / step",
        "speedup",
        "ideal",
        "fraction of ideal",
    ]
    return (
        f"### Default profile\n\nWorkload: `profiles/tiny-cpu.toml` alone (its environments, 32 x 8 samples, "
        f"`max_new_tokens = 12`), {DEFAULT_STEPS} steps from the same warm-up weights, async_level 0 and 1, "
        f"with the CPU binding of `deployment.cpus` {' and '.join(runs)} (off: the kernel places every thread; "
        "auto: inference on the first core, the trainer on the second, the orchestrator anywhere), the runs "
        "interleaved in each repeat; ideal and fraction of ideal as above, from each repeat's own synchronous run. "
        "Target: fraction of ideal >= 0.95.\n\n" + table(headers, rows)
    )


def run(ws: Workspace) -> str:
    main = DEFINITIONS + "\n" + report(measure(ws, repeats(3)))
    return main + "\n\n" + report_default(measure_default(ws, repeats(3)))
