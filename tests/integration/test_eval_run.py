"""`rollflow eval --run DIR --step N` end to end: the real CLI, a real embedded inference server as a supervised
component, the `eval` Prefect flow against the test harness's API, a real MLflow file store. Checked: the Arrow
shards (one row per sample, reproducible seeds), the summary against the rows, MLflow metrics at the evaluated
version, the markdown artifact; and (long) that an evaluation killed with SIGKILL midway and run again ends with
exactly the rows and summary of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from conftest import TINY, cli_argv, cli_env, descendants, start_cli

from engines.orchestrator.evaluation import task_seed
from tests.eval_fixture import make_run

pytestmark = pytest.mark.slow

TASKS, N = 6, 2
SETTINGS = ("--eval.num-tasks", str(TASKS), "--eval.n", str(N), "--eval.temperature", "1.0", "--eval.k", "[1, 2]",
            "--eval.correct-threshold", "0.2", "--eval.block-tasks", "2")  # fmt: skip


def _argv(run: Path, *extra: str) -> list[str]:
    return ["eval", "@", str(TINY), "--run", str(run), "--step", "0", *SETTINGS, *extra]


def _rows(directory: Path) -> list[dict]:
    table = ds.dataset(directory, format="ipc", partitioning="hive").to_table()
    rows = table.drop_columns(["chunk"]).to_pylist()
    return sorted(rows, key=lambda r: (r["env"], r["task_index"], r["sample_index"]))


def test_rollflow_eval_of_a_runs_step(tmp_path, prefect_api):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    run = make_run(tmp_path / "run")
    proc = subprocess.run(
        cli_argv(*_argv(run)), cwd=tmp_path, env=cli_env(prefect_api),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "eval step-000000" in proc.stdout and "pass@2" in proc.stdout  # the table, then the JSON
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    directory = run / "evals" / "step-000000"
    summary = json.loads((directory / "_summary.json").read_text())
    assert out["status"] == "new" and {k: out[k] for k in summary} == summary
    rows = _rows(directory)
    assert len(rows) == 2 * TASKS * N and summary["samples"] == len(rows)
    assert {r["policy_version"] for r in rows} == {0} and summary["policy_versions"] == [0]
    assert all(r["seed"] == task_seed(0, r["env"], r["task_index"]) for r in rows)
    assert all(r["correct"] == (r["reward"] >= 0.2) and len(r["completion_ids"]) <= 12 for r in rows)
    for env, m in summary["envs"].items():
        mine = [r for r in rows if r["env"] == env]
        assert m["tasks"] == TASKS and m["reward_mean"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine))
        assert 0 <= m["pass@1"] <= m["pass@2"] <= 1
        lo, hi = m["reward_ci95"]
        assert lo < m["reward_mean"] < hi
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")  # the results' default store: the run's
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.info.run_name == "eval-step-000000" and mlrun.info.status == "FINISHED"
    history = client.get_metric_history(mlrun.info.run_id, "eval/reverse-text/pass_at_2")
    assert [(m.step, m.value) for m in history] == [(0, summary["envs"]["reverse-text"]["pass@2"])]
    with get_client(sync_client=True) as prefect:
        artifacts = [a for a in prefect.read_artifacts() if a.key == "eval-step-000000"]
    assert artifacts and "| reverse-text |" in str(artifacts[-1].data)


def _wait_for_chunks(directory: Path, proc: subprocess.Popen, at_least: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(directory.glob("chunk=*/_manifest.json"))) < at_least:
        assert proc.poll() is None, "the evaluation ended before it could be killed"
        assert time.monotonic() < deadline, "no chunk committed in time"
        time.sleep(0.05)


@pytest.mark.long
def test_a_killed_evaluation_resumes_to_the_uninterrupted_result(tmp_path, prefect_api):
    run = make_run(tmp_path / "run")
    slow = ("--eval.requests-in-flight", "1", "--eval.num-tasks", "12")  # 12 chunks, one request at a time
    full = subprocess.run(
        cli_argv(*_argv(run, *slow, "--eval.name", "full")), cwd=tmp_path,
        env=cli_env(prefect_api), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert full.returncode == 0, full.stderr[-3000:]
    argv = _argv(run, *slow, "--eval.name", "killed")
    proc = start_cli(tmp_path, tmp_path / "killed.log", prefect_api, *argv)
    directory = run / "evals" / "killed"
    _wait_for_chunks(directory, proc, 2)
    os.kill(proc.pid, signal.SIGKILL)  # the eval process only; its inference server follows (parent-death signal)
    proc.wait()
    done = len(list(directory.glob("chunk=*/_manifest.json")))
    assert 2 <= done < 12 and not (directory / "_summary.json").exists()
    again = subprocess.run(cli_argv(*argv), cwd=tmp_path, env=cli_env(prefect_api), capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout[again.stdout.index("{") :])["status"] == "resumed"
    assert _rows(directory) == _rows(run / "evals" / "full")
    summaries = [json.loads((run / "evals" / n / "_summary.json").read_text()) for n in ("full", "killed")]
    assert summaries[0] == summaries[1]


def _server_pid(cli_pid: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in descendants(cli_pid):
            try:
                if b"_inference.json" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError("no inference server under the eval")


@pytest.mark.long
def test_a_stopped_evaluation_server_is_restarted_and_the_result_is_unchanged(tmp_path, prefect_api):
    """SIGSTOP of the eval's inference server: the stall watch stops it (no heartbeat for its timeout), a new one
    serves the remaining chunks, and the rows equal an uninterrupted evaluation's."""
    run = make_run(tmp_path / "run")
    slow = ("--eval.requests-in-flight", "1", "--eval.num-tasks", "12")
    # startup-s: a server stopped before its counter first moved is judged by the startup timeout
    stall = (
        "--restart.stall.inference-s",
        "5",
        "--restart.stall.heartbeat-s",
        "0.5",
        "--restart.stall.startup-s",
        "60",
    )
    full = subprocess.run(
        cli_argv(*_argv(run, *slow, "--eval.name", "full")), cwd=tmp_path,
        env=cli_env(prefect_api), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert full.returncode == 0, full.stderr[-3000:]
    log = tmp_path / "stopped.log"
    proc = start_cli(tmp_path, log, prefect_api, *_argv(run, *slow, *stall, "--eval.name", "stopped"))
    try:
        _wait_for_chunks(run / "evals" / "stopped", proc, 2)
        stopped = _server_pid(proc.pid)
        os.kill(stopped, signal.SIGSTOP)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "inference is stuck: " in text and "restart 1/" in text, text[-3000:]
    assert _rows(run / "evals" / "stopped") == _rows(run / "evals" / "full")
