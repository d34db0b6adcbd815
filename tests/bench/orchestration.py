"""Benchmark 5: orchestration overhead. What Prefect supervision and the storage commits add per RL step.

Prefect: the same workload through the real CLI (`rollflow rl`: Prefect flow, warm-up, three supervised
subprocesses whose every output line goes to the Prefect logger) against the same components supervised
directly by `runtime.process.supervise` (no Prefect), interleaved per repeat, 20 steps each. During the
Prefect run, the CPU time of every process in the CLI's tree is read from /proc at the first and the last
step's metrics row, split into the components (`python -m engines.*`) and the rest (the flow and Prefect's
API server).

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
import threading
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
# Prefect's CPU share is read in /proc's 10 ms ticks: over the workload's 8 steps one tick moved it by 0.2 points,
# over 20 steps by about 0.08.
STEPS = 20


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds used so far), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table_: dict[int, tuple[int, str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        table_[int(d.name)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)
    return table_


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds so far) of `root` and its descendants."""
    procs = _proc_table()
    tree, frontier = set(), {root}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier} - tree
    return {pid: procs[pid][1:] for pid in tree & procs.keys()}


def cpu_between(a: dict[int, tuple[str, float]], b: dict[int, tuple[str, float]], role) -> dict[str, float]:
    """CPU seconds each role used from reading `a` to reading `b`, per process (one that started in between counts
    from 0); `role(pid, command)` names a process from whichever reading has its command line (/proc can give an
    empty one)."""
    out: dict[str, float] = {}
    for pid, (cmd, cpu) in b.items():
        before_cmd, before = a.get(pid, ("", 0.0))
        name = role(pid, cmd or before_cmd)
        out[name] = out.get(name, 0.0) + cpu - before
    return out


def _role(pid: int, cmd: str, root: int) -> str:
    """The components (`python -m engines.*`), the flow process (`root`: the CLI, the flow, its supervisor threads
    and log forwarding) and the rest (Prefect's temporary API server)."""
    return "components" if " -m engines." in cmd else "flow" if pid == root else "api"


def _steps_done(out: Path) -> int:
    try:
        return sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0


def prefect_run(out: Path, steps: int) -> dict:
    """`rollflow rl` on the benchmark workload: CLI wall, run times, warm-up, and CPU by role over the
    steady steps (from the first step's metrics row to the last one's)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "rollflow.cli", "rl"]
    for p in PROFILES:
        cmd += ["@", str(p)]
    cmd += ["--output-dir", str(out), "--async-level", "1"]
    cmd += ["--max-steps", str(steps)]
    if QUICK:
        cmd += ["--sft.steps", "20"]
    # A private Prefect home: the temporary API's database must not be shared with other users' runs.
    home = out.parent / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # a loaded 2-core machine starts it slowly
    }
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    readings: list[dict[int, tuple[str, float]]] = []
    reader = threading.Thread(target=lambda: setattr(proc, "output", proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        done = _steps_done(out)
        if (len(readings) == 0 and done >= 1) or (len(readings) == 1 and done >= steps):
            readings.append(tree_cpu(proc.pid))
        time.sleep(0.05)
    wall = time.time() - t0
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"rollflow rl failed ({proc.returncode}):\n{proc.output[-3000:]}")
    warmup_end = (out / "weights" / "step=000000" / "_manifest.json").stat().st_mtime
    return {
        "wall": wall,
        "times": RunTimes.read(out),
        "warmup": warmup_end - (out / "config" / "run.json").stat().st_mtime,
        "phase": rl_phase(out),
        "cpu": cpu_between(*readings, role=lambda pid, cmd: _role(pid, cmd, proc.pid)) if len(readings) == 2 else None,
    }


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
    # A run 10,000 steps long: the writer appends one line whatever the file's length (storage/metrics.py).
    long_run = scratch / "long-run"
    long_run.mkdir(parents=True)
    lines = (json.dumps({**rows[-1], "step": i}) + "\n" for i in range(10_000))
    (long_run / "metrics.jsonl").write_text("".join(lines))
    big = MetricsLog(sfs, str(long_run))
    out["metrics.jsonl record at 10,000 steps"] = timed(lambda: big.record({**rows[-1], "step": 10_000}))
    return out


def measure(ws: Workspace, n: int) -> dict:
    direct, prefect = [], []
    for r in range(n):
        run = ws.run(f"orch-direct-r{r}", async_level=1, max_steps=STEPS)
        direct.append(RunTimes.read(run))
        steps = _steps_done(run)
        prefect.append(prefect_run(ws.root / f"orch-prefect-r{r}", steps))
    storage = storage_costs(ws.root / "orch-direct-r0", ws.root / "storage-scratch")
    return {"direct": direct, "prefect": prefect, "storage": storage, "steps": steps}


def report(m: dict) -> str:
    d = [t.wall_per_step for t in m["direct"]]
    p = [r["times"].wall_per_step for r in m["prefect"]]
    overhead = Stats([(pp - dd) / dd for pp, dd in zip(p, d, strict=True)])
    fixed = Stats([r["wall"] - r["warmup"] - r["phase"] for r in m["prefect"]])
    cpus = [r["cpu"] for r in m["prefect"] if r["cpu"]]
    share = Stats([(c.get("flow", 0.0) + c.get("api", 0.0)) / sum(c.values()) for c in cpus])
    per_step = {k: Stats([c.get(k, 0.0) / (m["steps"] - 1) for c in cpus]) for k in ("flow", "api")}
    rows = [
        ["direct supervision (baseline)", Stats(d).fmt(unit=" s"), "-"],
        ["Prefect flow (`rollflow rl`)", Stats(p).fmt(unit=" s"), ratio_stats(p, d).fmt() + "x"],
    ]
    prefect_text = [
        table(["supervision", "wall / step", "ratio"], rows),
        f"CPU used during the steady steps by the flow process ({per_step['flow'].fmt(unit=' s')} per step) and "
        f"Prefect's temporary API server ({per_step['api'].fmt(unit=' s')} per step): **{share.fmt(2)}** of all "
        "CPU the run used (the components used the rest). This is what Prefect supervision takes from the "
        "steps on a machine whose cores are shared; target <= 2%.",
        f"Wall-time view, (Prefect - direct) / direct per repeat: {overhead.fmt(2)} (the difference of two "
        "noisy runs; on this shared machine it swings by more than Prefect's CPU share explains). Fixed cost "
        "per run outside the RL phase (interpreter and Prefect start, the temporary API, flow set-up, "
        "teardown, summary; warm-up excluded; the first repeat also creates the Prefect database): "
        f"{fixed.fmt(unit=' s')}; warm-up itself: {Stats([r['warmup'] for r in m['prefect']]).fmt(unit=' s')}.",
    ]
    step = Stats(d).median
    storage_rows = [[k, num(v * 1000) + " ms", f"{100 * v / step:.2f}%"] for k, v in m["storage"].items()]
    commit = sum(v for k, v in m["storage"].items() if "10,000" not in k)
    return "\n\n".join(
        [
            *prefect_text,
            table(["storage operation", "median per step", "fraction of wall / step"], storage_rows),
            f"Storage commit protocol per step, all of the above but the 10,000-step line: "
            f"{num(commit * 1000)} ms, **{100 * commit / step:.2f}%** of the direct wall / step. The "
            "10,000-step line is one record appended to a metrics.jsonl of 10,000 rows on the local disk: the "
            "writer appends a step (fsync'd) rather than rewriting the file, so its cost should not grow with the run.",
        ]
    )


def run(ws: Workspace) -> str:
    return __doc__.split("\n\n", 1)[1] + "\n" + report(measure(ws, repeats(3)))
