"""The Slurm path end to end, against a real single-node Slurm cluster (infra/slurm/up.sh, brought up
here as root) and a real Prefect API: a `rollflow-slurm` work pool and worker started with Prefect's
CLI, the deployments of infra/prefect.yaml, one sbatch job per flow run, components as srun steps.

What Slurm says (squeue -s, scontrol) is asserted, not our own logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, prefect_cli, processes_mentioning

from runtime import slurm

PROFILES = ["profiles/tiny-cpu.toml", "tests/profiles/slurm-short.toml"]
POOL = "rollflow-slurm"
COMPONENT_STEPS = {"rollflow-warmup", "rollflow-inference", "rollflow-orchestrator", "rollflow-trainer"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("bringing up the Slurm cluster (infra/slurm/up.sh) needs root")
    proc = subprocess.run([str(ROOT / "infra/slurm/up.sh")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def _create_process_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template), overwrite=True)


def _pause_schedules(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(name)
        for schedule in dep.schedules:
            client.update_deployment_schedule(dep.id, schedule.id, active=False)
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
        for run in runs:
            if run.state is not None and run.state.is_scheduled():
                client.delete_flow_run(run.id)


@contextlib.contextmanager
def slurm_worker_running(api: str, work: Path) -> Iterator[Path]:
    """A rollflow-slurm pool created with Prefect's CLI (`--type rollflow-slurm`), the deployments of
    infra/prefect.yaml, and `prefect worker start --pool` in the background in `work` (its batch scripts and
    job output under work/slurm-jobs). Also used by the soak's Slurm segment (tests/soak/slurm.py)."""
    prefect_cli(api, "work-pool", "create", POOL, "--type", POOL, "--overwrite")
    _create_process_pool("rollflow-local")
    prefect_cli(api, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml")
    _pause_schedules("resume-unfinished/resume-unfinished-slurm")  # the tests start it by hand
    env = {**cli_env(api), "ROLLFLOW_HOME": str(ROOT), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    log = open(work / "worker.log", "ab")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", POOL],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield work
    finally:
        os.killpg(worker.pid, signal.SIGTERM)  # before the API goes away: a worker without its server hangs
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        log.close()


@pytest.fixture(scope="module")
def slurm_worker(prefect_api, slurm_cluster, tmp_path_factory):
    with slurm_worker_running(prefect_api, tmp_path_factory.mktemp("slurm-worker")) as work:
        yield work


def _start(deployment: str, parameters: dict, job_variables: dict | None = None, name: str | None = None):
    from prefect.deployments import run_deployment

    variables = {"poll_interval_s": 1.0, **(job_variables or {})}  # the worker follows the job every second
    return run_deployment(deployment, parameters=parameters, job_variables=variables, timeout=0, flow_run_name=name)


def _read(run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _job_id(run_id, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = _read(run_id)
        if run.infrastructure_pid:
            return run.infrastructure_pid
        assert run.state is None or not run.state.is_final(), run.state
        time.sleep(0.5)
    raise AssertionError(f"flow run {run_id} got no Slurm job in {timeout_s}s")


def _follow(run_id, job_id: str, timeout_s: float = 300, until=None) -> tuple[object, set[str]]:
    """Poll until the flow run is final (or `until(steps seen)`); returns (flow run, step names seen)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen |= set(slurm.steps(job_id))
        run = _read(run_id)
        if (run.state is not None and run.state.is_final()) or (until and until(seen)):
            return run, seen
        time.sleep(0.5)
    raise AssertionError(f"flow run {run_id} (job {job_id}) did not end in {timeout_s}s; steps seen {seen}")


def _wait_job_gone(job_id: str, timeout_s: float = 60) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = slurm.job_state(job_id)
        if state not in slurm.ACTIVE_STATES:
            return state
        time.sleep(0.5)
    raise AssertionError(f"Slurm job {job_id} still there after {timeout_s}s")


def _metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _audit(out: Path, max_steps: int) -> None:
    """Every step committed exactly once: rollouts, metrics, weights; unique sample ids."""
    import pyarrow.dataset as ds

    from storage.fs import committed_steps, get_fs

    fs, root = get_fs(str(out))
    assert committed_steps(fs, f"{root}/rollouts") == list(range(1, max_steps + 1))
    assert _metrics_steps(out) == list(range(1, max_steps + 1))
    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()
    ids = table.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "a sample was committed twice"
    for v in range(max_steps + 1):
        assert (out / "weights" / f"step={v:06d}" / "_manifest.json").exists()
    assert json.loads((out / "state.json").read_text())["status"] == "finished"


def test_a_deployment_run_completes_as_one_job_with_srun_steps(tmp_path, slurm_worker):
    out = tmp_path / "run"
    fr = _start(
        "rl-from-profile/rl-slurm", {"profiles": PROFILES, "output_dir": str(out), "overrides": {"max_steps": 2}}
    )
    job_id = _job_id(fr.id)
    run, seen = _follow(fr.id, job_id)
    assert run.state.is_completed(), (run.state, (slurm_worker / "worker.log").read_text()[-3000:])
    assert seen >= COMPONENT_STEPS, f"Slurm showed steps {seen}"
    final = _wait_job_gone(job_id)
    assert final == "COMPLETED", final
    _audit(out, 2)
    assert (out / "checkpoints" / "step=000002" / "trainer" / "_manifest.json").exists()


@pytest.mark.parametrize(
    ("job_variables", "slurm_says"),
    [
        ({"partition": "nosuch"}, "invalid partition"),
        ({"nodes": 3}, "more processors requested than permitted"),
    ],
)
def test_an_sbatch_rejection_fails_the_run_with_slurms_message(tmp_path, slurm_worker, job_variables, slurm_says):
    out = tmp_path / "run"
    fr = _start("rl-from-profile/rl-slurm", {"profiles": PROFILES, "output_dir": str(out)}, job_variables)
    run, _ = _follow(fr.id, "0", timeout_s=60)
    assert run.state.is_failed(), run.state
    assert slurm_says in run.state.message.lower(), run.state.message
    assert not run.infrastructure_pid and not out.exists()  # nothing started


@pytest.mark.parametrize(
    ("job_variables", "name", "said"),
    [
        ({"partition": "debug\ntouch {marker}"}, None, "job variable partition: 'debug\\ntouch"),
        ({"env": {"X=1;touch {marker};Y": "1"}}, None, "job variable env: environment variable name"),
        ({"time_limit": "an hour"}, None, "job variable time_limit: 'an hour' is not a slurm time"),
        ({}, "calm-otter\ntouch {marker}", "the flow run's name (it names the slurm job)"),
    ],
)
def test_hostile_job_variables_fail_the_run_before_sbatch(tmp_path, slurm_worker, job_variables, name, said):
    """Job variables (and the flow run's name) come from whoever can reach the Prefect API: a value that
    would become a line of the batch script fails the flow run in the worker; no script, no job."""
    marker, out = tmp_path / "pwned", tmp_path / "run"
    variables = json.loads(json.dumps(job_variables).replace("{marker}", str(marker)))
    name = name and name.replace("{marker}", str(marker))
    fr = _start("rl-from-profile/rl-slurm", {"profiles": PROFILES, "output_dir": str(out)}, variables, name)
    run, _ = _follow(fr.id, "0", timeout_s=60)
    assert run.state.is_failed(), run.state
    assert "the slurm worker refused the job" in run.state.message.lower(), run.state.message
    assert said in run.state.message.lower(), run.state.message
    assert not run.infrastructure_pid and not out.exists() and not marker.exists()
    assert not list(slurm_worker.rglob(f"{fr.id}*")), "no batch script was written"


def test_quoted_sbatch_values_reach_slurm_as_written(tmp_path, slurm_cluster):
    """sbatch reads shell-style quotes in #SBATCH lines: a job name with a space, an output path with a
    space and an option value that bash would read as a pipe arrive whole."""
    from config.placement import SlurmJobConfig
    from launch.slurm import render_sbatch

    logs = tmp_path / "my logs"
    logs.mkdir()
    slurm_cfg = SlurmJobConfig(mem="100M", time_limit="1", extra_sbatch=["--comment=a|b"], signal_before_s=0)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(slurm_cfg, 1, "prefect-calm otter", "true", {}, str(logs / "o-%j.out")))
    proc = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    try:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    finally:
        slurm.cancel(job_id)
    assert "JobName=prefect-calm otter\n" in shown or "JobName=prefect-calm otter " in shown, shown
    assert f"StdOut={logs}/o-{job_id}.out" in shown, shown
    assert "Comment=a|b" in shown, shown


def test_a_cancellation_in_prefect_leaves_no_job_step_or_process(tmp_path, slurm_worker):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    out = tmp_path / "run"
    fr = _start(
        "rl-from-profile/rl-slurm", {"profiles": PROFILES, "output_dir": str(out), "overrides": {"max_steps": 50}}
    )
    job_id = _job_id(fr.id)
    _follow(fr.id, job_id, until=lambda seen: "rollflow-trainer" in seen)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(fr.id, Cancelling(), force=True)
    assert _wait_job_gone(job_id) in ("CANCELLED", None)
    assert slurm.steps(job_id) == []
    deadline = time.monotonic() + 30
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(out)) == []
    # The flow may report the termination signal as Crashed first; the worker then settles the run as
    # Cancelled once the job is gone (flows/slurm_worker.py `_settle`), within its poll interval.
    deadline = time.monotonic() + 30
    while not (run := _read(fr.id)).state.is_cancelled() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run.state.is_cancelled(), run.state


@pytest.mark.long  # a 2-minute Slurm job plus its resumption (~4 min): `make test-long`
def test_walltime_stops_the_job_and_resume_unfinished_carries_the_run_to_the_end(tmp_path, slurm_worker):
    runs = tmp_path / "runs"
    # Longer than the job's first minute even on an idle machine: a clean-clone CI run finished 80 steps (about
    # 1 s each) before a warning at 75-105 s. 120 steps of >= 0.7 s plus start-up and warm-up (~15 s) outlast a
    # warning at 45-75 s; under load the first job does less and the resumed one the rest.
    out, steps = runs / "a", 120
    params = {"profiles": PROFILES, "output_dir": str(out), "overrides": {"max_steps": steps}}
    # Slurm checks time limits about every 30 s: with a 2-minute job the warning comes 45-75 s after the start,
    # leaving the flow 45 s or more to checkpoint and stop before Slurm's kill.
    fr = _start("rl-from-profile/rl-slurm", params, {"time_limit": "2", "signal_before_s": 75})
    job_id = _job_id(fr.id)
    run, seen = _follow(fr.id, job_id, timeout_s=180)
    assert "rollflow-trainer" in seen
    assert not run.state.is_completed(), "the run should not fit in the job"
    assert "walltime" in (run.state.message or "").lower(), run.state
    assert _wait_job_gone(job_id) != "TIMEOUT", "the flow should stop before Slurm kills it"
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "failed" and not (out / "lease.json").exists()
    done = _metrics_steps(out) if (out / "metrics.jsonl").exists() else []
    assert len(done) < steps

    fr2 = _start("resume-unfinished/resume-unfinished-slurm", {"runs_root": str(runs), "max_runs": 1})
    run2, seen2 = _follow(fr2.id, _job_id(fr2.id), timeout_s=600)
    assert run2.state.is_completed(), run2.state
    assert "rollflow-trainer" in seen2
    _audit(out, steps)


def test_a_worker_without_slurm_on_path_says_so(prefect_api, slurm_worker, tmp_path):
    env = {**cli_env(prefect_api), "PATH": str(tmp_path)}  # no sbatch, squeue, ... here
    prefect = str(Path(sys.executable).parent / "prefect")
    proc = subprocess.run(
        [prefect, "worker", "start", "--pool", POOL, "--run-once"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "'sbatch' is not on PATH" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_rollflow_submit_rejected_by_sbatch_prints_slurms_message(tmp_path, slurm_cluster):
    from conftest import cli_argv

    out = tmp_path / "run"
    args = ["submit", *[t for p in PROFILES for t in ("@", str(ROOT / p))], "--output-dir", str(out)]
    proc = subprocess.run(
        cli_argv(*args, "--deployment.slurm.partition", "nosuch"),
        cwd=tmp_path, env=cli_env(None), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "invalid partition specified: nosuch" in proc.stderr
    assert not (out / "state.json").exists()
