"""MLflow bookkeeping for a run: create the run with its (secret-free) params, close it with a status. Which
tracking URI a run uses is config/tracking.py's `resolve_tracking_uri`, shared with the trainer.

The flow process calls these through `in_child` (`python -m runtime.tracking`, one operation as JSON on stdin,
its result as JSON on stdout): importing MLflow brings pandas, SQLAlchemy and Alembic (about 140 MB PSS once
the sqlite store is opened) that Python never gives back, and the flow process lives for the whole run while
it needs MLflow for two calls, one before the first component starts and one after the last one exits.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
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
    otherwise leave a half-migrated database that MLflow cannot open again, and the run could not resume.
    The migrations (dozens of Alembic revisions: seconds, on the path to every run's first step) run once per
    MLflow version: later stores start as a copy of that empty, migrated one (`_migrated_template`)."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    path = Path(tracking_uri.removeprefix("sqlite:///"))
    if path.exists():
        return
    for stale in path.parent.glob(f".{path.name}.init-*"):  # left by a killed initialization
        stale.unlink()
    tmp = path.with_name(f".{path.name}.init-{os.getpid()}")
    template = _migrated_template()
    if template is None:
        _migrate(tmp)
    else:
        shutil.copyfile(template, tmp)
        _rebase_default_experiment(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _migrate(db: Path) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{db}").search_experiments(max_results=1)  # runs the migrations


def _migrated_template() -> Path | None:
    """An empty store migrated by this MLflow version, in the user's cache (made now if missing, atomically);
    None where the cache cannot be written (the caller migrates its store itself)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollflow"
    template = cache / f"mlflow-{importlib.metadata.version('mlflow')}-empty.db"
    if template.exists():
        return template
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{template.name}.init-{os.getpid()}"
        _migrate(tmp)
        os.replace(tmp, template)
    except OSError:
        return None
    return template


def _rebase_default_experiment(db: Path) -> None:
    """The copied store's experiment 0 ("Default") as MLflow would have made it here and now: artifacts under
    `./mlruns/0` of this process, created at this time (the template holds another directory's and time)."""
    now = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
            "WHERE experiment_id = 0",
            (os.path.abspath(os.path.join("mlruns", "0")), now, now),
        )


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


_prestarted: subprocess.Popen | None = None  # the next in_child's process, importing MLflow already


def _spawn() -> subprocess.Popen:
    return subprocess.Popen(  # noqa: PLW1509 - die_with_parent only sets the parent-death signal
        [sys.executable, "-m", "runtime.tracking"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
    )  # fmt: skip


def prestart() -> None:
    """Start the next `in_child`'s process now: it imports MLflow (seconds) while the caller starts up (the CLI:
    while the local Prefect API boots and Prefect is imported). Unused, it exits when this process does."""
    global _prestarted
    if _prestarted is None:
        _prestarted = _spawn()


def in_child(operation: str, *args: Any) -> Any:
    """`OPERATIONS[operation](*args)` in a short-lived child process; its return value, or a RuntimeError with
    the child's error. Arguments travel on stdin (the tracking URI may hold credentials: never in argv)."""
    global _prestarted
    proc, _prestarted = _prestarted or _spawn(), None
    try:
        out, err = proc.communicate(json.dumps({"operation": operation, "args": args}), timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"MLflow {operation} did not finish in {CHILD_TIMEOUT_S:.0f}s") from None
    results = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"MLflow {operation} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return json.loads(results[-1].removeprefix(RESULT_PREFIX))


def _warm_store_code() -> None:
    """Open a scratch copy of the migrated template store: MLflow's first client on a sqlite store loads its
    SQLAlchemy and Alembic code (0.8 s measured; the next store opens in 0.03 s). Done by a prestarted child
    while its parent starts up, it is off the path to the run's first step. A failure only loses the head start."""
    import tempfile

    from mlflow.tracking import MlflowClient

    template = _migrated_template()
    if template is None:
        return
    with tempfile.TemporaryDirectory(prefix="rollflow-mlflow-warm-") as tmp:
        scratch = Path(tmp) / "warm.db"
        shutil.copyfile(template, scratch)
        MlflowClient(f"sqlite:///{scratch}").get_experiment_by_name("rollflow")


def _child_main() -> None:
    import mlflow.tracking  # noqa: F401 - first, before waiting for the operation (prestart)

    with contextlib.suppress(Exception):
        _warm_store_code()
    raw = sys.stdin.read()
    if not raw:  # a prestarted child nobody used: its parent exited
        return
    request = json.loads(raw)
    result = OPERATIONS[request["operation"]](*request["args"])
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child_main()
