"""Cancel means cancel, against a real Prefect API: a flow run cancelled in Prefect (or under a cancelled parent)
closes its run as `cancelled`; the scheduled `resume-unfinished` flow leaves a cancelled run alone; `rollflow
resume` still resumes it. The end-to-end case (a real `rollflow rl` cancelled with `prefect flow-run cancel`,
then SIGTERM as a worker sends it) is `long`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, prefect_cli, processes_mentioning, start_cli
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelling

from flows.cancel import outcome
from flows.resume import resume_unfinished
from storage.runstate import find_resumable

seen: list[str] = []


@flow
def closing() -> None:
    seen.append(outcome(False, get_run_logger()))


@flow
def cancelled_midway() -> None:
    """Closes once before and once after its own cancellation, and starts a subflow under the cancelled run
    (the `rl` subflow of a scheduled resume-unfinished run that someone cancelled)."""
    seen.append(outcome(False, get_run_logger()))
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.get_id(), Cancelling(message="cancelled by the test"), force=True)
    seen.append(outcome(False, get_run_logger()))
    closing()


def _run_dir(runs: Path, name: str, status: str) -> Path:
    """A run directory as the `rl` flow leaves it (config and state), with `status` in state.json."""
    d = runs / name
    (d / "config").mkdir(parents=True)
    (d / "config" / "run.json").write_text(json.dumps({"run_id": name}))
    state = {"run_id": name, "mlflow_run_id": None, "status": status, "attempts": 1, "resumes": []}
    (d / "state.json").write_text(json.dumps(state))
    return d


def test_a_cancelled_flow_run_closes_as_cancelled_and_resume_unfinished_leaves_it(tmp_path, prefect_api):
    seen.clear()
    cancelled_midway(return_state=True)
    assert seen == ["failed", "cancelled", "cancelled"]
    runs = tmp_path / "runs"
    cancelled = _run_dir(runs, "a", "cancelled")
    assert find_resumable(str(runs)) == []
    assert resume_unfinished(str(runs)) == []  # a real scheduled pass, reported to the API
    assert json.loads((cancelled / "state.json").read_text())["status"] == "cancelled"
    _run_dir(runs, "b", "failed")
    assert find_resumable(str(runs)) == [str(runs / "b")]  # a failed run stays resumable


def _state(out: Path) -> dict:
    try:
        return json.loads((out / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _rl_flow_run(out: Path):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    mine = [r for r in runs if (r.parameters.get("config") or {}).get("output_dir") == str(out)]
    return max(mine, key=lambda r: r.created) if mine else None


@pytest.mark.long  # a real tiny RL run cancelled, a resume-unfinished pass, an explicit resume (~4 min here)
def test_a_run_cancelled_in_prefect_stays_cancelled_until_resumed_by_hand(tmp_path, prefect_api):
    runs, log = tmp_path / "runs", tmp_path / "cli.log"
    out = runs / "a"
    resume_toml = ROOT / "tests" / "profiles" / "resume.toml"
    cli = start_cli(tmp_path, log, prefect_api, "rl", "@", str(TINY), "@", str(resume_toml), "--output-dir", str(out))
    try:
        _wait(lambda: _state(out).get("attempts", 0) >= 1, 180, "the first attempt")
        fr = _rl_flow_run(out)
        assert fr is not None
        prefect_cli(prefect_api, "flow-run", "cancel", str(fr.id))
        os.kill(cli.pid, signal.SIGTERM)  # what the worker does once the run is Cancelling
        assert cli.wait(timeout=120) != 0
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    _wait(lambda: processes_mentioning(str(out)) == [], 30, "the components to stop")
    assert _state(out)["status"] == "cancelled", log.read_text()[-3000:]
    assert not (out / "lease.json").exists()
    assert resume_unfinished(str(runs)) == []
    assert _state(out)["status"] == "cancelled"
    resumed = start_cli(tmp_path, log, prefect_api, "resume", str(out), "--max-steps", "3")
    assert resumed.wait(timeout=400) == 0, log.read_text()[-3000:]
    state = _state(out)
    assert state["status"] == "finished" and len(state["resumes"]) == 1
