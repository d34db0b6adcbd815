"""The run's MLflow sqlite store is created whole or not at all (runtime/tracking.initialize_store); which
tracking URI the flow and the trainer use is one rule (config/tracking.resolve_tracking_uri)."""

from __future__ import annotations

import pytest

from config.tracking import resolve_tracking_uri
from runtime.tracking import initialize_store


def test_a_new_store_appears_only_migrated_and_a_killed_attempt_leaves_nothing(tmp_path):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "mlflow.db"
    stale = tmp_path / ".mlflow.db.init-12345"
    stale.write_bytes(b"half a migration from a killed flow")
    uri = f"sqlite:///{db}"
    initialize_store(uri)
    assert db.exists() and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("e"))
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    before = db.stat().st_ino
    initialize_store(uri)  # an existing store is left as it is
    assert db.stat().st_ino == before


def test_other_stores_are_left_to_mlflow(tmp_path):
    initialize_store("http://127.0.0.1:5000")
    initialize_store(f"file://{tmp_path}/mlruns")
    assert list(tmp_path.iterdir()) == []


def test_the_configured_uri_wins_over_the_environment_which_wins_over_the_run_directory(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://env:5000"}
    assert resolve_tracking_uri("http://cfg:5000", str(tmp_path), env) == "http://cfg:5000"
    assert resolve_tracking_uri(None, str(tmp_path), env) == "http://env:5000"
    assert resolve_tracking_uri(None, str(tmp_path), {}) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert resolve_tracking_uri(None, f"file://{tmp_path}", {}) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert resolve_tracking_uri(None, "s3://bucket/run", {}) is None  # no MLflow beside an object-store run
    assert resolve_tracking_uri(None, "s3://bucket/run", env) == "http://env:5000"


def test_a_redacted_configured_uri_is_completed_from_the_environment_only_when_it_is_the_same_uri(tmp_path):
    full = {"MLFLOW_TRACKING_URI": "https://user:secret@mlflow.example/x"}
    # the trainer: trainer.json holds the flow's URI redacted, its environment the same URI in full
    assert resolve_tracking_uri("https://***@mlflow.example/x", str(tmp_path), full) == full["MLFLOW_TRACKING_URI"]
    for env, said in [({}, "is not set"), ({"MLFLOW_TRACKING_URI": "https://u:p@other/x"}, "holds another URI")]:
        with pytest.raises(ValueError, match=rf"credentials redacted and MLFLOW_TRACKING_URI {said}"):
            resolve_tracking_uri("https://***@mlflow.example/x", str(tmp_path), env)


def test_later_stores_copy_one_migrated_template_with_the_default_experiment_made_here(tmp_path, monkeypatch):
    """The migrations run once per MLflow version (runtime/tracking._migrated_template); a copied store holds
    the same schema and revision as one MLflow migrates itself, and its "Default" experiment is the one MLflow
    would make in this directory, not the template's."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from runtime.tracking import _migrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    initialize_store(f"sqlite:///{tmp_path / 'first.db'}")  # migrates the template, copies it
    [template] = (tmp_path / "cache" / "rollflow").glob("mlflow-*-empty.db")
    made = template.stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    copied, migrated = tmp_path / "copied.db", tmp_path / "migrated.db"
    initialize_store(f"sqlite:///{copied}")
    _migrate(migrated)  # what MLflow itself makes here
    assert template.stat().st_mtime_ns == made  # reused, not migrated again

    def shape(db):
        with sqlite3.connect(db) as conn:
            tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            # tables and columns: the SQL text may differ (MLflow creates a store's tables one of two ways)
            schema = sorted((t, c[1], c[2], c[3]) for t in tables for c in conn.execute(f"PRAGMA table_info('{t}')"))
            revision = conn.execute("SELECT version_num FROM alembic_version").fetchall()
            default = conn.execute("SELECT name, artifact_location, lifecycle_stage FROM experiments").fetchall()
        return schema, revision, default

    assert shape(copied) == shape(migrated)
    assert shape(copied)[2] == [("Default", str(tmp_path / "mlruns" / "0"), "active")]
    client = MlflowClient(f"sqlite:///{copied}")
    run = client.create_run(client.create_experiment("e"))
    assert client.get_run(run.info.run_id).info.status == "RUNNING"


def test_a_prestarted_child_warms_mlflow_on_a_scratch_copy_and_leaves_the_template_and_tmp_as_they_were(
    tmp_path, monkeypatch
):
    """runtime/tracking._warm_store_code opens a copy of the template (so the run's own store then opens in
    milliseconds) and removes it; the shared template is never written."""
    import hashlib

    from runtime.tracking import _migrated_template, _warm_store_code

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    template = _migrated_template()
    assert template is not None
    before = hashlib.sha256(template.read_bytes()).hexdigest(), template.stat().st_mtime_ns
    _warm_store_code()
    assert (hashlib.sha256(template.read_bytes()).hexdigest(), template.stat().st_mtime_ns) == before
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_trainer_mirrors_every_row_to_mlflow_off_the_step_and_survives_a_broken_store(tmp_path, caplog):
    """engines/trainer/tracking.py: rows go to metrics.jsonl at once and to MLflow from the sink's thread; after
    `close` MLflow has every step. A store that cannot open costs a warning, and metrics.jsonl keeps every row."""
    from mlflow.tracking import MlflowClient

    from engines.trainer.tracking import Tracker
    from runtime.tracking import start_mlflow_run
    from storage.fs import get_fs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    initialize_store(uri)
    run_id = start_mlflow_run(uri, "e", "r", {}, {})
    fs, root = get_fs(str(tmp_path / "run"))
    tracker = Tracker(fs, root, uri, run_id)
    for step in range(1, 31):
        tracker.record({"step": step, "loss": 1.0 / step, "reward_mean": step / 30, "note": "text is skipped"})
    tracker.merge(30, {"eval/reward": 0.5})
    tracker.close()
    history = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in range(1, 31)]
    assert [m.value for m in MlflowClient(uri).get_metric_history(run_id, "eval/reward")] == [0.5]
    assert len(tracker.metrics.rows()) == 30 and tracker.metrics.row(30)["eval/reward"] == 0.5

    broken = Tracker(fs, root, f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}", run_id)
    with caplog.at_level("WARNING", logger="rollflow.trainer"):
        broken.record({"step": 31, "loss": 0.1})
        broken.close()
    assert "MLflow:" in caplog.text and "metrics.jsonl" in caplog.text
    assert tracker.metrics.row(31)["loss"] == 0.1


def test_the_trainer_logs_to_mlflow_without_importing_pandas_yet_other_threads_still_can(tmp_path):
    """A fresh interpreter, as the trainer: MLflow imported on the sink's thread with pandas hidden from that
    thread's imports only (48 MB less per trainer); the metrics still reach the store, and pandas stays importable
    on any other thread afterwards."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        from runtime.tracking import initialize_store, start_mlflow_run
        from engines.trainer.tracking import Tracker
        from storage.fs import get_fs
        uri = "sqlite:///{tmp_path}/mlflow.db"
        initialize_store(uri)
        run_id = start_mlflow_run(uri, "e", "r", {{}}, {{}})
        for name in [m for m in sys.modules if m.partition(".")[0] in ("mlflow", "pandas")]:
            del sys.modules[name]  # as in the trainer, which has imported neither
        fs, root = get_fs("{tmp_path}/run")
        tracker = Tracker(fs, root, uri, run_id)
        tracker.record({{"step": 1, "loss": 0.5}})
        tracker.close()
        hidden = "pandas" not in sys.modules
        from mlflow.tracking import MlflowClient
        print(hidden, [m.value for m in MlflowClient(uri).get_metric_history(run_id, "loss")])
        import pandas
        print(pandas.DataFrame({{"a": [1]}}).shape)
        """
    )
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["True [0.5]", "(1, 1)"]
