"""Node loss on the namespace cluster (infra/slurm/netns.sh): a multi-node run under Slurm that loses whole nodes.

Data flow: `rollflow submit` (tests/profiles/netns-3node.toml: inference on rfnode1, the 2-rank FSDP2 trainer and the
orchestrator on rfnode2 and rfnode3) -> at seeded trainer steps every process of one trainer node's namespace is
SIGKILLed, its slurmd included -> Slurm declares the node down (SlurmdTimeout) and requeues the job itself -> the node
is brought back -> the requeued job's `rollflow rl` resumes the run (rollflow/cli.py `requeued_flags`) -> the run
finishes and is audited (tests/integration/test_resume.py `_assert_nothing_lost_or_duplicated`). A `FaultRecord`
("node:loss") per loss: the time from the kill to the first trainer step recorded by the requeued job, and the steps
rolled back. `node_loss_segment` is the soak driver's segment; tests/integration/test_multinode.py runs it too.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from tests.soak.audit import audit_run, committed_rollouts
from tests.soak.record import FaultRecord, SegmentResult

ROOT = Path(__file__).resolve().parents[2]
NETNS = ROOT / "infra" / "slurm" / "netns.sh"
PROFILES = [ROOT / "profiles" / "tiny-cpu-fsdp2.toml", ROOT / "tests" / "profiles" / "netns-3node.toml"]
TRAINER_NODES = (2, 3)  # rfnode1 serves inference; the flow and the batch shell run there too
# Slurm holds a requeued job for about 2 minutes (its begin time) before it starts it again: a loss costs ~3 minutes.
LOSS_BUDGET_S = 360.0


def cluster(*args: str, timeout_s: float = 120.0) -> str:
    """infra/slurm/netns.sh with `args`; its stdout. Raises on failure with the script's stderr."""
    proc = subprocess.run([str(NETNS), *args], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"netns.sh {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def slurm_conf() -> str:
    return cluster("env").strip().split("=", 1)[1]


def slurm_env() -> dict[str, str]:
    """The submitting shell: this cluster's SLURM_CONF; no PREFECT_API_URL (a loopback API of the root namespace is
    out of the nodes' reach: the job starts its own temporary one on rfnode1)."""
    env = {**os.environ, "SLURM_CONF": slurm_conf(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    return env


def submit(out: Path, max_steps: int) -> str:
    """`rollflow submit` of the 3-node profile; returns the Slurm job id."""
    argv = [sys.executable, "-m", "rollflow.cli", "submit", *[t for p in PROFILES for t in ("@", str(p))]]
    argv += ["--output-dir", str(out), "--max-steps", str(max_steps)]
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(argv, cwd=out.parent, env=slurm_env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"rollflow submit failed: {proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def squeue(job_id: str) -> str:
    """The job's state as squeue shows it ('' once it has left the queue)."""
    cmd = ["squeue", "-h", "-j", job_id, "-o", "%T"]
    proc = subprocess.run(cmd, env=slurm_env(), capture_output=True, text=True, timeout=30)
    return proc.stdout.strip()


def node_state(node: int) -> str:
    cmd = ["sinfo", "-h", "-N", "-n", f"rfnode{node}", "-o", "%t"]
    return subprocess.run(cmd, env=slurm_env(), capture_output=True, text=True, timeout=30).stdout.strip()


def trained_steps(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_until(what: str, check, timeout_s: float, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(every_s)


def lose_node(out: Path, job_id: str, node: int, t_start: float) -> FaultRecord:
    """Kill every process of rfnode<node>; once Slurm counts it down, bring it back; measure until the requeued job
    records a trainer step."""
    log = out / "logs" / f"slurm-{job_id}.out"
    before, at = trained_steps(out), time.monotonic()
    requeues = log.read_text(errors="replace").count("Slurm requeued this job") if log.exists() else 0
    cluster("kill", str(node))
    wait_until(f"rfnode{node} counted down", lambda: node_state(node).startswith("down"), 60, every_s=1)
    cluster("start", str(node))
    lowest = [before]

    def resumed_and_stepped() -> bool:
        steps = trained_steps(out)
        lowest[0] = min(lowest[0], steps)
        text = log.read_text(errors="replace") if log.exists() else ""
        return text.count("Slurm requeued this job") > requeues and steps > lowest[0]

    wait_until(f"a trainer step after losing rfnode{node}", resumed_and_stepped, LOSS_BUDGET_S, every_s=0.5)
    recover_s = time.monotonic() - at
    note = f"rfnode{node} at trainer step {before}"
    return FaultRecord("node:loss", at - t_start, round(recover_s, 1), before - lowest[0], note)


def node_loss_run(workdir: Path, seed: int, losses: int, max_steps: int) -> SegmentResult:
    """One run of `max_steps` on the namespace cluster with `losses` node losses at seeded trainer steps."""
    rng, out, t0 = random.Random(seed), workdir / "run", time.monotonic()
    points = sorted(rng.sample(range(2, max_steps - 1), losses))
    job_id = submit(out, max_steps)
    result = SegmentResult("multinode", "tiny-cpu-fsdp2 on 3 namespace nodes", max_steps, 0.0)
    snapshots: dict[int, str] = {}
    for point in points:
        wait_until(f"trainer step {point}", lambda p=point: trained_steps(out) >= p or not squeue(job_id), 300)
        if not squeue(job_id):
            result.problems.append(f"the job ended before trainer step {point}")
            break
        snapshots.update(committed_rollouts(out))
        result.faults.append(lose_node(out, job_id, rng.choice(TRAINER_NODES), t0))
    wait_until(f"Slurm job {job_id} done", lambda: not squeue(job_id), 300, every_s=1)
    result.wall_s = round(time.monotonic() - t0, 1)
    result.problems += audit_run(out, max_steps, snapshots)
    return result


def node_loss_segment(workdir: Path, seed: int, minutes: float) -> SegmentResult:
    """The soak driver's segment: one node loss per ~4 minutes of the budget (each costs ~3), at least one."""
    losses = max(1, int(minutes // 4))
    brought_up = not Path(slurm_conf()).exists()
    cluster("up", "3")
    try:
        return node_loss_run(workdir, seed, losses, max_steps=6 + 4 * losses)
    finally:
        if brought_up:
            cluster("down")
