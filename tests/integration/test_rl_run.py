"""End to end: the real CLI, Prefect, three subprocesses over HTTP, shards, metrics and MLflow.

Runs a shortened tiny-cpu profile (tests/profiles/ci-short.toml) twice: asynchronous through the
`rollflow` command (ephemeral Prefect API), and synchronous through the flow in-process against the
Prefect test harness, where the run summary artifact (with its curves) and the live progress artifacts
(`rl-progress` at 100%, `rl-run-status`) are read back from the API.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from conftest import cli_argv, cli_env, processes_mentioning

from config.loader import load_run_config
from storage.rollouts import staleness

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/ci-short.toml"]

pytestmark = pytest.mark.slow


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _shards(out: Path):
    return ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()


def _assert_run_is_sound(out: Path, max_steps: int, max_off_policy: int) -> list[int]:
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))
    table = _shards(out)
    ids = table.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "sample_id must be unique across the run"
    stale = [
        staleness(s, v)
        for s, v in zip(table.column("step").to_pylist(), table.column("policy_version").to_pylist(), strict=True)
    ]
    assert min(stale) >= 0 and max(stale) <= max_off_policy
    ends = table.column("policy_version_end").to_pylist()
    assert all(e >= v for e, v in zip(ends, table.column("policy_version").to_pylist(), strict=True))
    # Sampler and trainer run the same fp32 weights, so only float rounding separates their logprobs: measured
    # at most 5.4e-9 (40 async steps) and 4.5e-9 (8 sync steps). 1e-7 leaves room for other CPUs' rounding.
    kls = [r["mismatch_kl"] for r in rows if r["mismatch_kl"] is not None]
    print(f"mismatch_kl: max {max(kls, default=float('nan')):.1e} over {len(kls)} steps")
    assert kls and max(kls) <= 1e-7
    assert (out / "weights" / f"step={max_steps:06d}" / "_manifest.json").exists()
    assert (out / "checkpoints" / f"step={max_steps:06d}" / "trainer" / "_manifest.json").exists()
    return stale


def _run_cli(out: Path, *extra: str, api_url: str | None = None) -> subprocess.CompletedProcess:
    args = ["rl", *[t for p in PROFILES for t in ("@", str(p))], "--output-dir", str(out), *extra]
    env = cli_env(api_url)
    return subprocess.run(cli_argv(*args), cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)


def test_async_run_via_cli_learns(tmp_path):
    out = tmp_path / "run"
    proc = _run_cli(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cfg = load_run_config(PROFILES)
    stale = _assert_run_is_sound(out, cfg.max_steps, cfg.max_off_policy_steps)
    assert 1 in stale, "async_level=1 should produce samples one policy behind"
    rewards = [r["reward_mean"] for r in _metrics(out)]
    rise = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    assert rise >= 0.05, f"reward did not rise: {rewards}"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rollflow").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == list(range(1, cfg.max_steps + 1))
    assert run.data.params["async_level"] == "1"


def test_sync_run_reports_to_a_prefect_server_and_is_on_policy(tmp_path, prefect_api):
    from prefect.client.orchestration import get_client

    out = tmp_path / "run"
    # the mechanics, not the learning: a short warm-up
    args = ("--async-level", "0", "--max-steps", "8", "--sft.steps", "20", "--tracking.mlflow", "false")
    proc = _run_cli(out, *args, api_url=prefect_api)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stale = _assert_run_is_sound(out, 8, load_run_config(PROFILES).max_off_policy_steps)
    assert set(stale) == {0}, "async_level=0 must be fully on-policy"
    assert json.loads(proc.stdout[proc.stdout.index("{") :])["staleness_histogram"] == {"0": len(stale)}
    with get_client(sync_client=True) as client:  # the API is shared by the session's tests: pick this run's
        runs = client.read_flow_runs()
        (flow_run,) = [r for r in runs if r.parameters.get("config", {}).get("output_dir") == str(out)]
        assert flow_run.state is not None and flow_run.state.is_completed()
        task_names = {t.name for t in client.read_task_runs() if t.flow_run_id == flow_run.id}
        artifacts = [a for a in client.read_artifacts() if a.flow_run_id == flow_run.id]
    assert {"warmup", "inference", "orchestrator", "trainer"} <= task_names
    by_key = {a.key: a for a in artifacts}
    assert by_key["rl-progress"].type == "progress" and by_key["rl-progress"].data == 100.0  # updated in place
    status = str(by_key["rl-run-status"].data)
    assert status.startswith("### step 8 / 8 (100%)") and "| reward_mean | 8 |" in status
    summary = str(by_key["rl-run-summary"].data)
    assert "reward_last5" in summary and "### reward_mean by step\n" in summary
    table = summary.split("### reward_mean by step")[1].split("###")[0]
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + 8  # header + every step
    assert "progress view:" not in proc.stdout + proc.stderr  # no failed read or update on the way
    assert "the last at step 8 / 8" in proc.stdout + proc.stderr


def test_a_failing_component_stops_the_run_and_every_process(tmp_path, prefect_api):
    out = tmp_path / "run"
    # The engine's port is taken, so the inference server fails on every attempt: a real failure the flow
    # must contain. With one restart allowed, the flow restarts once, then gives up with a clear message.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _run_cli(
            out, "--inference.port", str(taken.getsockname()[1]), "--sft.steps", "1",
            "--restart.max_restarts", "1", "--restart.backoff_s", "0.1", api_url=prefect_api,
        )  # fmt: skip
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "inference exited with code 3" in log and "address already in use" in log
    assert "restart 1/1" in log and "2 failures in a row without checkpoint progress" in log
    assert processes_mentioning(str(out)) == []
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "failed"
