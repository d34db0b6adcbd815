"""MLflow bookkeeping for a run: create the run with its (secret-free) params, close it with a status. Which
tracking URI a run uses is config/tracking.py's `resolve_tracking_uri`, shared with the trainer.

The flow process calls these through `in_child` (`python -m runtime.tracking`, one operation as JSON on stdin,
its result as JSON on stdout): importing MLflow brings pandas, SQLAlchemy and Alembic (about 140 MB PSS once
the sqlite store is opened) that Python never gives back, and the flow process lives for the whole run while
it needs MLflow for two calls, one before the first component starts and one after the last one exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.process import die_with_parent
from storage.fs import fsync_dir

CHILD_TIMEOUT_S = 600.0  # a remote tracking server may be slow; MLflow's own HTTP retries stay well inside this
RESULT_PREFIX = "rollflow-tracking-result: "


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = str(v)[:500]
    return out


def initialize_store(tracking_uri: str) -> None:
    """Create a new local sqlite store under a temporary name and rename it into place once MLflow's schema
    migrations are done. A kill during them (a second or more; the flow can be killed at any time) would
    otherwise leave a half-migrated database that MLflow cannot open again, and the run could not resume."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    path = Path(tracking_uri.removeprefix("sqlite:///"))
    if path.exists():
        return
    for stale in path.parent.glob(f".{path.name}.init-*"):  # left by a killed initialization
        stale.unlink()
    tmp = path.with_name(f".{path.name}.init-{os.getpid()}")
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{tmp}").search_experiments(max_results=1)  # runs the migrations
    os.replace(tmp, path)
    fsync_dir(path.parent)


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts (the trainer's sample images): beside a local sqlite store
    (`mlartifacts/` next to the database, in the run directory by default), not in the `mlruns/` of whatever
    directory the trainer runs in; None (the server's choice) for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()


def start_mlflow_run(tracking_uri: str, experiment: str, run_name: str, params: dict, tags: dict) -> str:
    from mlflow.tracking import MlflowClient

    initialize_store(tracking_uri)
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifact_location(tracking_uri))
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    items = list(_flatten(params).items())
    from mlflow.entities import Param

    for i in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
    return run.info.run_id


def reopen_mlflow_run(tracking_uri: str, mlflow_run_id: str, tags: dict[str, str]) -> None:
    """Mark a resumed run's MLflow run active again; settings changed on resume become tags (params
    are immutable in MLflow)."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    client.update_run(mlflow_run_id, status="RUNNING")
    client.log_batch(mlflow_run_id, tags=[RunTag(k[:250], str(v)[:5000]) for k, v in tags.items()])


def end_mlflow_run(tracking_uri: str, mlflow_run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_terminated(mlflow_run_id, status=status)


OPERATIONS: dict[str, Callable[..., Any]] = {
    "start": start_mlflow_run,
    "reopen": reopen_mlflow_run,
    "end": end_mlflow_run,
}


def in_child(operation: str, *args: Any) -> Any:
    """`OPERATIONS[operation](*args)` in a short-lived child process; its return value, or a RuntimeError with
    the child's error. Arguments travel on stdin (the tracking URI may hold credentials: never in argv)."""
    payload = json.dumps({"operation": operation, "args": args})
    proc = subprocess.run(  # noqa: PLW1509 - die_with_parent only sets the parent-death signal
        [sys.executable, "-m", "runtime.tracking"], input=payload, capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S, preexec_fn=die_with_parent,
    )  # fmt: skip
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"MLflow {operation} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(results[-1].removeprefix(RESULT_PREFIX))


def _child_main() -> None:
    request = json.loads(sys.stdin.read())
    result = OPERATIONS[request["operation"]](*request["args"])
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child_main()
