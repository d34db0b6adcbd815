"""Benchmark 5: orchestration overhead. What Prefect supervision and the storage commits add per RL step.

Prefect: the same workload through the real CLI (`rollflow rl`: Prefect flow, warm-up, three supervised
subprocesses whose every output line goes to the Prefect logger) against the same components supervised
directly by `tasks.process.supervise` (no Prefect), interleaved per repeat.

Storage: the commit protocol's work per step (rollout shard and weights written with checksums, fsync
and manifest, read back and verified; the metrics.jsonl record), timed in-process on a finished run's
real payloads, as a fraction of that run's wall time per step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.harness import (
    PROFILES,
    QUICK,
    ROOT,
    RunTimes,
    Stats,
    Workspace,
    num,
    ratio_stats,
    repeats,
    table,
    timed,
)

TITLE = "5. Orchestration overhead"


def prefect_run(out: Path) -> tuple[float, RunTimes, float]:
    """(CLI wall s, run times, warm-up s) of `rollflow rl` on the benchmark workload."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rollflow.cli", "rl"]
    for p in PROFILES:
        cmd += ["@", str(p)]
    cmd += ["--output-dir", str(out), "--async-level", "1"]
    if QUICK:
        cmd += ["--max-steps", "3", "--sft.steps", "20"]
    # A private Prefect home: the temporary API's database must not be shared with other users' runs.
    env = {**os.environ, "PREFECT_HOME": str(out.parent / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"rollflow rl failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    warmup_end = (out / "weights" / "step=000000" / "_manifest.json").stat().st_mtime
    warmup = warmup_end - (out / "config" / "run.json").stat().st_mtime
    return wall, RunTimes.read(out), warmup


def rl_phase(out: Path) -> float:
    """Seconds from the warm-up's publication to the last trainer step's metrics row."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows[-1]["time"] - (out / "weights" / "step=000000" / "_manifest.json").stat().st_mtime


def storage_costs(run: Path, scratch: Path) -> dict[str, float]:
    """Median seconds per step of each commit-protocol operation, redone on the run's own payloads."""
    from storage import rollouts, weights
    from storage.fs import get_fs
    from storage.metrics import MetricsLog

    fs, root = get_fs(str(run))
    sfs, sroot = get_fs(str(scratch))
    shutil.rmtree(scratch, ignore_errors=True)
    costs: dict[str, list[float]] = {
        k: [] for k in ("rollouts write", "rollouts read", "weights publish", "weights load")
    }
    for step in rollouts.committed_rollout_steps(fs, root):
        table_, manifest = rollouts.read_step(fs, root, step)
        state = weights.load(fs, weights.version_dir(root, step))
        costs["rollouts write"].append(
            timed(lambda t=table_, s=step, m=manifest: rollouts.write_step(sfs, sroot, s, t, m))
        )
        costs["rollouts read"].append(timed(lambda s=step: rollouts.read_step(sfs, sroot, s)))
        costs["weights publish"].append(timed(lambda s=step, sd=state: weights.publish(sfs, sroot, s, sd)))
        costs["weights load"].append(timed(lambda s=step: weights.load(sfs, weights.version_dir(sroot, s))))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    log = MetricsLog(sfs, sroot)
    out = {k: Stats(v).median for k, v in costs.items()}
    out["metrics.jsonl record"] = Stats([timed(lambda r=r: log.record(r)) for r in rows]).median
    big = MetricsLog(sfs, sroot)
    for i in range(10_000):
        big.rows[i] = {**rows[-1], "step": i}
    out["metrics.jsonl record at 10,000 steps"] = timed(lambda: big.record({**rows[-1], "step": 10_000}))
    return out


def measure(ws: Workspace, n: int) -> dict:
    direct, prefect, walls, warmups, phases = [], [], [], [], []
    for r in range(n):
        direct.append(RunTimes.read(ws.run(f"orch-direct-r{r}", async_level=1)))
        wall, times, warmup = prefect_run(ws.root / f"orch-prefect-r{r}")
        prefect.append(times)
        walls.append(wall)
        warmups.append(warmup)
        phases.append(rl_phase(ws.root / f"orch-prefect-r{r}"))
    storage = storage_costs(ws.root / "orch-direct-r0", ws.root / "storage-scratch")
    return {
        "direct": direct,
        "prefect": prefect,
        "walls": walls,
        "warmups": warmups,
        "phases": phases,
        "storage": storage,
    }


def report(m: dict) -> str:
    d = [t.wall_per_step for t in m["direct"]]
    p = [t.wall_per_step for t in m["prefect"]]
    overhead = Stats([(pp - dd) / dd for pp, dd in zip(p, d, strict=True)])
    fixed = Stats([w - wu - ph for w, wu, ph in zip(m["walls"], m["warmups"], m["phases"], strict=True)])
    rows = [
        ["direct supervision (baseline)", Stats(d).fmt(unit=" s"), "-"],
        ["Prefect flow (`rollflow rl`)", Stats(p).fmt(unit=" s"), ratio_stats(p, d).fmt() + "x"],
    ]
    step = Stats(d).median
    storage_rows = [[k, num(v * 1000) + " ms", f"{100 * v / step:.2f}%"] for k, v in m["storage"].items()]
    per_step = sum(v for k, v in m["storage"].items() if "10,000" not in k)
    return "\n\n".join(
        [
            table(["supervision", "wall / step", "ratio"], rows),
            f"Prefect's per-step overhead, (Prefect - direct) / direct per repeat: **{overhead.fmt(2)}** "
            "(target <= 2%; a negative value means the difference is below this machine's noise). "
            f"Fixed cost per run outside the RL phase (interpreter and Prefect start, the temporary API, flow "
            f"set-up, teardown, summary; warm-up excluded; the first repeat also creates the Prefect database): "
            f"{fixed.fmt(unit=' s')}; warm-up itself: "
            f"{Stats(m['warmups']).fmt(unit=' s')}.",
            table(["storage operation", "median per step", "fraction of wall / step"], storage_rows),
            f"Storage commit protocol per step, all of the above but the 10,000-step line: "
            f"{num(per_step * 1000)} ms, **{100 * per_step / step:.2f}%** of the direct wall / step. The "
            "metrics.jsonl line shows the cost growing with the run: the file is rewritten whole each step.",
        ]
    )


def run(ws: Workspace) -> str:
    return __doc__.split("\n\n", 1)[1] + "\n" + report(measure(ws, repeats(3)))
