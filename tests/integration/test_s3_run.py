"""End to end on object storage: the tiny profile (shortened) runs with `output_dir = s3://...` against a
moto S3 server on 127.0.0.1, exactly as on a local folder: shards, weight publications (delta-encoded,
with retention), the checkpoint, metrics and configs all land in the bucket. The lake is then read with
`rollflow lake`, with pyarrow.dataset over pyarrow's own S3 filesystem and with Polars, none of which
go through rollflow's reader; and the storage credentials appear nowhere on disk, in logs or in MLflow.

Then the run is resumed there from an earlier checkpoint (`rollflow resume`) and extended by two steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.storage import StorageConfig
from storage import checkpoints, rollouts, weights
from storage import fs as sfs
from storage.metrics import read_metrics
from tests.s3util import BUCKET, CREDENTIALS, moto_s3

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/s3-short.toml"]
MAX_STEPS = 5
SAMPLES_PER_STEP = 8 * 8  # s3-short: batch_size 8, group_size 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(prefect_api):
    """A moto endpoint; credentials in a child-process environment (never in config). The CLI reports to
    the session's Prefect API instead of starting a temporary one per command."""
    with moto_s3() as endpoint:
        env = {**os.environ, **CREDENTIALS, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": prefect_api}
        for k in ("AWS_ENDPOINT_URL", "AWS_PROFILE", sfs.CONFIG_STORAGE_ENV):
            env.pop(k, None)
        yield endpoint, env


def _rollflow(cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _rl_args(out: str, endpoint: str, *extra: str) -> list[str]:
    args = ["rl"]
    for p in PROFILES:
        args += ["@", str(p)]
    return [
        *args,
        "--output-dir",
        out,
        "--storage.endpoint_url",
        endpoint,  # through config this time; the fault tests use AWS_ENDPOINT_URL
        "--storage.weights_delta",
        "true",
        "--storage.weights_full_every",
        "3",
        "--storage.keep_last_weights",
        "4",
        "--storage.keep_last_checkpoints",
        "2",
        "--checkpoint.interval",
        "2",
        *extra,
    ]


def test_tiny_run_on_s3(s3, tmp_path, monkeypatch):
    endpoint, env = s3
    out = f"s3://{BUCKET}/runs/tiny"
    mlflow_db = tmp_path / "mlflow.db"
    proc = _rollflow(
        tmp_path,
        env,
        *_rl_args(out, endpoint, "--tracking.mlflow", "true", "--tracking.tracking_uri", f"sqlite:///{mlflow_db}"),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # the flow's watcher read metrics.jsonl from the bucket, without a failure, up to the last step
    assert "progress view:" not in log and f"the last at step {MAX_STEPS} / {MAX_STEPS}" in log

    for k, v in CREDENTIALS.items():  # this test process reads the bucket with the same settings
        monkeypatch.setenv(k, v)
    fs, root = sfs.get_fs(out, StorageConfig(endpoint_url=endpoint))

    # everything a local run writes is in the bucket, committed
    assert rollouts.committed_rollout_steps(fs, root) == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in read_metrics(fs, root)] == list(range(1, MAX_STEPS + 1))
    assert fs.exists(f"{root}/checkpoints/step={MAX_STEPS:06d}/trainer/_manifest.json")
    assert fs.exists(f"{root}/tokenizer/tokenizer.json")
    run_json = json.loads(fs.cat_file(f"{root}/config/run.json"))
    assert run_json["storage"]["endpoint_url"] == endpoint
    # retention (keep 4, checkpoint at 5) with delta chains: 0 went once the checkpoint existed,
    # 1 stays as the full base of delta 2; encodings: 1 and 3 full (first of the trainer, every 3rd)
    versions = weights.latest_version(fs, root)
    assert versions == MAX_STEPS
    kept = sfs.committed_steps(fs, weights.weights_root(root))
    assert kept == [1, 2, 3, 4, 5], kept
    encodings = {v: sfs.read_manifest(fs, weights.version_dir(root, v))["encoding"] for v in kept}
    assert encodings == {1: "full", 2: "delta", 3: "full", 4: "delta", 5: "delta"}
    final = weights.load(fs, weights.version_dir(root, MAX_STEPS))  # rebuilt through 4 -> 3, checksum-checked
    assert final and all(t.is_floating_point() for t in final.values())

    # `rollflow lake` reads it back
    lake = _rollflow(tmp_path, {**env, "AWS_ENDPOINT_URL": endpoint}, "lake", out, "--json")
    assert lake.returncode == 0, lake.stderr[-3000:]
    report = json.loads(lake.stdout)
    assert report["rollout_steps"] == list(range(1, MAX_STEPS + 1))
    assert report["samples"] == MAX_STEPS * SAMPLES_PER_STEP
    assert sum(report["staleness_histogram"].values()) == report["samples"]
    assert report["weights"]["encodings"] == {"full": 2, "delta": 3}
    assert 0 < report["weights"]["payload_ratio"] < 1
    assert report["errors"] == []

    # readers that do not use rollflow: pyarrow.dataset over pyarrow's S3 filesystem, and Polars
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    s3fs_ = pafs.S3FileSystem(endpoint_override=endpoint, region="us-east-1")
    table = ds.dataset(f"{BUCKET}/runs/tiny/rollouts", filesystem=s3fs_, format="ipc", partitioning="hive").to_table()
    assert table.num_rows == report["samples"]
    assert sorted(set(table.column("step").to_pylist())) == list(range(1, MAX_STEPS + 1))
    ids = table.column("sample_id").to_pylist()
    assert len(set(ids)) == len(ids)
    import polars as pl

    opts = {"aws_endpoint_url": endpoint, "aws_allow_http": "true", "aws_region": "us-east-1"}
    df = pl.scan_ipc(f"{out}/rollouts/**/*.arrow", storage_options=opts, hive_partitioning=True).collect()
    assert df.height == report["samples"]
    assert df.group_by("step").len().sort("step")["len"].to_list() == [SAMPLES_PER_STEP] * MAX_STEPS

    # credentials: not in configs on storage, component logs, CLI output or MLflow params
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    key_id = CREDENTIALS["AWS_ACCESS_KEY_ID"]
    for path in fs.find(f"{root}/config"):
        text = fs.cat_file(path).decode()
        assert secret not in text and key_id not in text, path
    logs = list((tmp_path / "rollflow-logs").rglob("*.log"))
    assert {p.name for p in logs} >= {"warmup.log", "inference.log", "orchestrator.log", "trainer.log"}
    for p in logs:
        assert secret not in p.read_text(), p
    assert secret not in log and secret not in lake.stdout + lake.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{mlflow_db}")
    (run,) = client.search_runs([client.get_experiment_by_name("rollflow").experiment_id])
    assert run.data.params["storage.endpoint_url"] == endpoint and secret not in json.dumps(run.data.params)
    assert run.info.status == "FINISHED"

    # resume on S3: drop the final checkpoint (as if the run died after step 5's rollouts and weights
    # but before its checkpoint), then continue to 7 steps from checkpoint 4
    assert checkpoints.checkpoint_steps(fs, root) == [4, 5]  # interval 2, keep the last 2
    fs.rm(f"{root}/checkpoints/step={MAX_STEPS:06d}", recursive=True)
    resumed = _rollflow(
        tmp_path, {**env, "AWS_ENDPOINT_URL": endpoint}, "resume", out, "--max-steps", str(MAX_STEPS + 2)
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    steps = list(range(1, MAX_STEPS + 3))
    assert rollouts.committed_rollout_steps(fs, root) == steps
    assert [r["step"] for r in read_metrics(fs, root)] == steps  # step 5 trained again, recorded once
    assert checkpoints.checkpoint_steps(fs, root) == [6, 7]
    assert weights.latest_version(fs, root) == MAX_STEPS + 2
    table = ds.dataset(f"{BUCKET}/runs/tiny/rollouts", filesystem=s3fs_, format="ipc", partitioning="hive").to_table()
    ids = table.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == len(steps) * SAMPLES_PER_STEP  # nothing lost, nothing duplicated
    lake = _rollflow(tmp_path, {**env, "AWS_ENDPOINT_URL": endpoint}, "lake", out, "--json", "--verify")
    assert lake.returncode == 0, lake.stdout[-3000:] + lake.stderr[-3000:]
    assert json.loads(lake.stdout)["errors"] == []
