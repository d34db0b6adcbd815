"""Open, reopen and close a run: the bookkeeping around the `rl` flow's attempts.

A new run claims its directory, starts an MLflow run (in a child process: runtime/tracking.py `in_child`)
and writes `state.json`. A resumed run checks
that only compatible settings changed, reopens the same MLflow run (recording the changes as tags)
and appends to the state's resume history. Closing records the outcome (finished, failed or cancelled)
in both places, unless the flow lost its lease.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from config.run import RunConfig
from config.tracking import refuse_credentials_in_config, resolve_tracking_uri
from runtime.rundir import (
    check_resumable,
    claim_output_dir,
    new_run_id,
    public_config,
    stored_config,
    write_run_config,
)
from runtime.slurm import requeued
from runtime.tracking import in_child
from storage import fence, runstate
from storage.fs import get_fs


@dataclass
class RunHandle:
    run_id: str
    tracking_uri: str | None  # full URI, credentials included: passed to the trainer by environment only
    state: runstate.RunState


def _tracking_uri(cfg: RunConfig) -> str | None:
    refuse_credentials_in_config(cfg.tracking.tracking_uri)
    return resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.output_dir) if cfg.tracking.mlflow else None


def _ensure_mlflow_run(cfg: RunConfig, run: RunHandle) -> None:
    """Create the MLflow run unless the state names one (a run killed before it had one gets it now)."""
    if run.tracking_uri is None or run.state.mlflow_run_id is not None:
        return
    tags = {"rollflow.run_id": run.run_id}
    run.state.mlflow_run_id = in_child(
        "start", run.tracking_uri, cfg.tracking.experiment, run.run_id, public_config(cfg), tags
    )
    runstate.write_state(*get_fs(cfg.output_dir, cfg.storage), run.state)


def start_new_run(cfg: RunConfig, overwrite: bool) -> RunHandle:
    """Claim the directory and write config and state first: from then on `rollflow resume` works."""
    claim_output_dir(cfg.output_dir, overwrite, cfg.storage)
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    fs.makedirs(root, exist_ok=True)
    run_id = new_run_id(cfg)
    run = RunHandle(run_id, _tracking_uri(cfg), runstate.RunState(run_id=run_id, mlflow_run_id=None))
    write_run_config(cfg, run.run_id)
    runstate.write_state(fs, root, run.state)
    _ensure_mlflow_run(cfg, run)
    return run


def continues_requeued_job(cfg: RunConfig, logger) -> bool:
    """A requeued Slurm job (preempted, then put back in the queue) reruns its batch script, so the flow
    run starts `rl` again with the same parameters, without `resume`: it must continue the run it began,
    not refuse the directory (or, with `overwrite`, wipe it). True when this job was requeued and the run
    it started is there to resume."""
    if not requeued():
        return False
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    if runstate.read_state(fs, root) is None or not fs.exists(f"{root}/config/run.json"):
        return False  # preempted before the run was opened: start it as new
    logger.warning("this Slurm job was requeued (preempted?): resuming its run from the last checkpoint")
    return True


def reopen_run(cfg: RunConfig, logger) -> RunHandle:
    changes = check_resumable(cfg)
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    state = runstate.read_state(fs, root)
    assert state is not None  # check_resumable refuses a directory without one
    run = RunHandle(stored_config(cfg.output_dir, cfg.storage)["run_id"], _tracking_uri(cfg), state)
    n = len(state.resumes) + 1
    if changes:
        listed = ", ".join(f"{k}: {o!r} -> {v!r}" for k, (o, v) in changes.items())
        logger.info(f"resuming with changed settings: {listed}")
    if run.tracking_uri and state.mlflow_run_id:
        tags = {f"rollflow.resume.{n}.{k}": f"{o} -> {v}" for k, (o, v) in changes.items()}
        tags[f"rollflow.resume.{n}.time"] = time.ctime()
        in_child("reopen", run.tracking_uri, state.mlflow_run_id, tags)
    state.resumes.append({"time": time.time(), "changes": {k: list(v) for k, v in changes.items()}})
    state.status = "running"
    runstate.write_state(fs, root, state)
    _ensure_mlflow_run(cfg, run)
    return run


def close_run(cfg: RunConfig, run: RunHandle, outcome: str) -> None:
    """Record `outcome` (finished | failed | cancelled) in state.json and MLflow; nothing once the lease is lost
    (the run belongs to whoever took it over)."""
    current = fence.active()
    if current is not None and current.lost.is_set():
        return
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    run.state.status = outcome
    runstate.write_state(fs, root, run.state)
    if run.tracking_uri and run.state.mlflow_run_id:
        in_child("end", run.tracking_uri, run.state.mlflow_run_id, MLFLOW_STATUS[outcome])


MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
