"""The run's MLflow sqlite store is created whole or not at all (tasks/tracking.initialize_store)."""

from __future__ import annotations

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
