"""Run-directory claims and secret redaction (flows/prepare.py, rollflow/redact.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.redact import redact_url
from config.run import RunConfig
from rollflow.cli import main
from runtime.rundir import RunDirError, claim_output_dir, public_config, write_configs

TINY = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.toml"


def _fake_run(root: Path) -> None:
    (root / "config").mkdir(parents=True)
    (root / "config" / "run.json").write_text("{}")
    (root / "weights" / "step=000000").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("{}\n")


def test_existing_run_is_refused_without_overwrite(tmp_path):
    _fake_run(tmp_path)
    with pytest.raises(RunDirError, match="--overwrite"):
        claim_output_dir(str(tmp_path), overwrite=False)
    assert (tmp_path / "weights").exists()


def test_overwrite_removes_only_what_a_run_owns(tmp_path):
    _fake_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    claim_output_dir(str(tmp_path), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_data_that_is_not_a_rollflow_run_is_never_deleted(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(RunDirError, match="not a rollflow run"):
        claim_output_dir(str(tmp_path), overwrite=True)
    assert (tmp_path / "checkpoints").exists()


def test_cli_refuses_an_existing_run_with_exit_2_before_starting_anything(tmp_path, capsys):
    _fake_run(tmp_path)
    assert main(["rl", "@", str(TINY), "--output-dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["rl", "@", str(TINY), "--output-dir", str(tmp_path), "--dry-run"]) == 2
    assert (tmp_path / "config" / "run.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://user:pw@mlflow.example:5000/x", "https://***@mlflow.example:5000/x"),
        ("https://mlflow.example/x", "https://mlflow.example/x"),
        ("sqlite:////tmp/a@b/mlflow.db", "sqlite:////tmp/a@b/mlflow.db"),
        (None, None),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected


def test_credentials_in_the_tracking_uri_never_reach_disk(tmp_path):
    secret = "https://alice:s3cret@mlflow.example"
    cfg = RunConfig(output_dir=str(tmp_path))
    cfg.tracking.tracking_uri = secret
    assert "s3cret" not in json.dumps(public_config(cfg))
    write_configs(cfg, "rid", "http://127.0.0.1:1", tracking_uri=secret, mlflow_run_id="m")
    written = "".join(p.read_text() for p in (tmp_path / "config").iterdir())
    assert "s3cret" not in written and "***@mlflow.example" in written
