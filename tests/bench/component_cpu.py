"""Where a run's CPU goes, per process: the peer workload's rollflow run (tests/bench/peer_trl.py, as a user runs
it: `rollflow rl` with Prefect, the three components and MLflow), CPU seconds per RL step of each process in the
CLI's tree, read from /proc at the 3rd and the last-but-one step's metrics row.

`python -m tests.bench.component_cpu [--steps 30] [--quick]` prints its markdown section (`make bench-quick` runs
it). It warms up once into a scratch directory (version 0, as peer_trl does) and runs the RL steps from there.
A component that runs 100% of the wall time per step is the bottleneck; the others have CPU to spare.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.bench import harness, peer_trl
from tests.bench.harness import QUICK, Workspace, table
from tests.bench.orchestration import _steps_done, cpu_between, tree_cpu

TITLE = "CPU per RL step by process (tests/bench/component_cpu.py)"
ROLES = ("engines.trainer", "engines.inference", "engines.orchestrator", "mlflow", "uvicorn", "rollflow.cli")


def _role(pid: int, cmd: str) -> str:
    return next((r for r in ROLES if r in cmd), cmd.split(" -c ")[0][:60] or f"pid {pid}")


def measure(root: Path, steps: int) -> dict:
    publication = harness.warm_up(peer_trl.run_config(root / "warmup")) / "weights" / "step=000000"
    out = root / "run"
    shutil.rmtree(out, ignore_errors=True)
    first, last = 3, steps - 1
    argv = peer_trl.rollflow_argv(publication, out, steps)
    proc = subprocess.Popen(argv, env=peer_trl.base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    snaps: list[tuple[float, dict[int, tuple[str, float]]]] = []
    deadline = time.monotonic() + 120 + 30 * steps
    while proc.poll() is None and time.monotonic() < deadline:
        done = _steps_done(out)
        if (len(snaps) == 0 and done >= first) or (len(snaps) == 1 and done >= last):
            snaps.append((time.time(), tree_cpu(proc.pid)))
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    if proc.wait(timeout=60) != 0 or len(snaps) != 2:
        raise RuntimeError(f"rollflow rl exited {proc.returncode} with {len(snaps)} of 2 readings")
    (t0, a), (t1, b) = snaps
    n = last - first
    return {"steps": n, "wall": (t1 - t0) / n, "cpu": {k: v / n for k, v in cpu_between(a, b, _role).items()}}


def report(m: dict) -> str:
    rows = [
        [role, f"{cpu:.3f} s", f"{cpu / m['wall']:.0%}"] for role, cpu in sorted(m["cpu"].items(), key=lambda x: -x[1])
    ]
    rows.append(["all", f"{sum(m['cpu'].values()):.3f} s", f"{sum(m['cpu'].values()) / m['wall']:.0%}"])
    head = f"{m['steps']} steady steps, {m['wall']:.3f} s wall per step:\n\n"
    return head + table(["process", "CPU per step", "of the wall time"], rows)


def run(ws: Workspace) -> str:
    return __doc__.split("\n\n", 1)[1] + "\n" + report(measure(ws.root / "component-cpu", 6 if QUICK else 30))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tests.bench.component_cpu", description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="component-cpu-") as tmp:
        print(report(measure(Path(tmp), 6 if args.quick else args.steps)))
