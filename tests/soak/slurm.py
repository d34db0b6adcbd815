"""Soak segment under the real one-node Slurm: one run through the Slurm worker and the deployments of
infra/prefect.yaml, hit by a preemption and by its job's walltime, each recovered, then the resume audit.

  job 1 (rl-from-profile/rl-slurm, --time=3, walltime warning 75 s before it)
    at a trainer step drawn from the seed: PREEMPTION, as a preempting scheduler does it: SIGTERM to every
    process of the job (`scancel --signal=TERM --full`), then `scontrol requeue`. Slurm runs the same batch
    script again (SLURM_RESTART_COUNT=1); the flow sees the requeue and resumes its run from the last
    checkpoint (runtime/lifecycle.py `continues_requeued_job`).
  the requeued job 1 runs into its WALLTIME warning: the trainer checkpoints, the flow stops, the run stays
    unfinished; resume-unfinished-slurm (started here as its 10-minute schedule would) carries it to max_steps.
  audit: tests/integration/test_resume.py `_assert_nothing_lost_or_duplicated` on the run directory.

Each fault's recovery time runs from the injection (for the walltime: the warning reaching the batch shell)
to the first trainer step recorded by the run that resumed; steps rolled back = steps recorded before the
stop minus the checkpoint it resumed from. Needs root (it brings the cluster up with infra/slurm/up.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration suite's helpers

from conftest import ROOT  # noqa: E402
from test_resume import _assert_nothing_lost_or_duplicated, _committed_rollouts, _trained_steps  # noqa: E402
from test_slurm import PROFILES, _job_id, _read, _start, _wait_job_gone, slurm_worker_running  # noqa: E402

from runtime import slurm  # noqa: E402
from tests.soak.record import FaultRecord, SegmentResult  # noqa: E402
from tests.soak.recovery import resume_point, stepped_since  # noqa: E402

STEPS_PER_MINUTE = 50  # tiny-cpu on 2 loaded cores: 0.7-1.2 s a step
MIN_STEPS = 160  # more than the first job and its requeued run do before the walltime (~2 x 100 s)
JOB_LIMIT = {"time_limit": "3", "signal_before_s": 75}  # the warning 75-135 s after each (re)start


def preempt(job_id: str) -> None:
    """What a preempting scheduler does to a running batch job: SIGTERM to all its processes, then back
    into the queue."""
    subprocess.run(["scancel", "--signal=TERM", "--full", job_id], check=True, timeout=30)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)


def _resumes(out: Path) -> list[dict]:
    try:
        return json.loads((out / "state.json").read_text())["resumes"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _wait(what: str, check, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(poll_s)
    return found


def wait_resumed(out: Path, t_fault: float, resumes_before: int, timeout_s: float = 600) -> tuple[float, int]:
    """After a fault that stopped the run: (seconds from `t_fault` to the first trainer step of the run that
    resumed it, steps rolled back). Steps recorded by the stopping run are counted until the resume."""
    last = _trained_steps(out)

    def first_resumed_step() -> bool:
        nonlocal last
        resumes = _resumes(out)
        if len(resumes) <= resumes_before:
            last = max(last, _trained_steps(out))
            return False
        return stepped_since(out, resumes[-1]["time"], last)

    _wait("a trainer step of the resumed run", first_resumed_step, timeout_s, poll_s=0.1)
    return time.monotonic() - t_fault, last - resume_point(out, last)


def _warning_seen(script_dir: Path, run_id, job_id: str) -> bool:
    out = script_dir / f"{run_id}-{job_id}.out"
    return out.exists() and "Slurm walltime warning (USR1)" in out.read_text(errors="replace")


def _final(run_id):
    run = _read(run_id)
    return run if run.state is not None and run.state.is_final() else None


def _run(out: Path, steps: int, rng: random.Random, script_dir: Path, t0: float, snapshots: dict, jobs: list):
    params = {"profiles": PROFILES, "output_dir": str(out), "overrides": {"max_steps": steps}}
    fr = _start("rl-from-profile/rl-slurm", params, JOB_LIMIT)
    job = _job_id(fr.id)
    jobs.append(job)
    point = rng.randint(2, 5)
    _wait(f"trainer step {point}", lambda: _trained_steps(out) >= point, 300)
    time.sleep(rng.uniform(0.0, 0.8))  # anywhere in a step
    snapshots.update(_committed_rollouts(out))  # committed before a fault: never written again
    t_fault, resumes = time.monotonic(), len(_resumes(out))
    preempt(job)
    recover_s, rolled = wait_resumed(out, t_fault, resumes)
    faults = [FaultRecord("slurm:preempt", t_fault - t0, recover_s, rolled, f"job {job} at step {point}")]

    _wait("the walltime warning", lambda: _warning_seen(script_dir, fr.id, job), 300, poll_s=0.5)
    snapshots.update(_committed_rollouts(out))
    t_fault, resumes = time.monotonic(), len(_resumes(out))
    run = _wait("the flow stopped at the walltime", lambda: _final(fr.id), 300)
    assert "walltime" in (run.state.message or "").lower(), run.state
    assert _wait_job_gone(job) != "TIMEOUT", "the flow should stop before Slurm kills it"
    fr2 = _start("resume-unfinished/resume-unfinished-slurm", {"runs_root": str(out.parent), "max_runs": 1})
    jobs.append(_job_id(fr2.id))
    recover_s, rolled = wait_resumed(out, t_fault, resumes)
    faults.append(FaultRecord("slurm:walltime", t_fault - t0, recover_s, rolled, f"job {job}, requeued once"))
    run2 = _wait("the resumed run to finish", lambda: _final(fr2.id), 60 * 30, poll_s=1)
    assert run2.state.is_completed(), run2.state
    return faults


@contextlib.contextmanager
def _prefect_api(api: str | None) -> Iterator[str]:
    if api:
        yield api
        return
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()
        try:
            yield PREFECT_API_URL.value()
        finally:
            os.environ.pop("PREFECT_API_URL", None)


def segment(workdir: Path, seed: int, minutes: float, *, api: str | None = None, worker: Path | None = None):
    """The Slurm segment. `api` / `worker`: a Prefect API and a running rollflow-slurm worker's directory
    to use (the integration test's fixtures); without them it brings up its own (cluster, API, worker)."""
    t0 = time.monotonic()
    steps = max(MIN_STEPS, int(minutes * STEPS_PER_MINUTE))
    result = SegmentResult(name=f"slurm-{seed}", profile="tiny-cpu", steps=steps, wall_s=0.0)
    out = workdir / "runs" / "slurm"
    with contextlib.ExitStack() as stack:
        if worker is None:
            subprocess.run([str(ROOT / "infra/slurm/up.sh")], check=True, capture_output=True, timeout=600)
            api = stack.enter_context(_prefect_api(api))
            (workdir / "worker").mkdir(parents=True, exist_ok=True)
            worker = stack.enter_context(slurm_worker_running(api, workdir / "worker"))
        snapshots: dict[int, str] = {}
        jobs: list[str] = []
        try:
            result.faults = _run(out, steps, random.Random(seed), worker / "slurm-jobs", t0, snapshots, jobs)
            _assert_nothing_lost_or_duplicated(out, steps, snapshots)
        except Exception as exc:  # noqa: BLE001 - the driver gets a result that names what failed
            result.problems.append(f"{type(exc).__name__}: {exc}"[:2000])
            for job in jobs:  # nothing of a failed segment keeps running
                slurm.cancel(job)
    result.wall_s = time.monotonic() - t0
    return result
