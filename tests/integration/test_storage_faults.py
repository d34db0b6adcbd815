"""Storage faults against a real S3 API on loopback: a moto server behind a proxy that answers 503,
resets connections or stalls. Transient faults are retried and the commit succeeds; an outage longer
than the retry budget raises `StorageUnavailable` naming the operation, path and budget, and what was
committed before stays readable and verified. Also: credentials never reach the config on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config.storage import StorageConfig
from storage import fs as sfs
from storage import rollouts
from storage.fs import CorruptError, StorageUnavailable, commit_dir, get_fs, read_manifest, read_verified
from tests.s3util import BUCKET, CREDENTIALS, FaultProxy, moto_s3
from tests.unit.test_rollouts import _rows

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/s3-short.toml"]

FAST = StorageConfig(timeout_s=1.0, retry_budget_s=20.0, retry_base_s=0.02, retry_max_backoff_s=0.2)


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3() as url:
        yield url


@pytest.fixture
def proxy(endpoint, monkeypatch):
    with FaultProxy(endpoint, stall_s=2.0) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        yield p


def _url(name: str) -> str:
    return f"s3://{BUCKET}/faults/{name}-{time.monotonic_ns()}"


@pytest.mark.parametrize("kind", ["503", "reset", "stall"])
def test_transient_faults_are_retried_and_the_commit_succeeds(proxy, kind, caplog):
    fs, root = get_fs(_url(kind), FAST)
    table = rollouts.to_table(_rows(1, n=4))
    proxy.fail_next(2, kind)
    rollouts.write_step(fs, root, 1, table, {"gen_s": 0.1})
    assert proxy.injected[kind] == 2
    assert "retry 1" in caplog.text
    proxy.fail_next(2, kind)  # reads are retried too
    back, manifest = rollouts.read_step(fs, root, 1)
    assert back.equals(table) and manifest["rows"] == 4
    assert proxy.injected[kind] == 4


def test_outage_longer_than_the_budget_fails_clearly_and_keeps_committed_data(proxy):
    url = _url("outage")
    fs, root = get_fs(url, FAST)
    commit_dir(fs, f"{root}/a", {"x.bin": b"committed" * 100}, {"k": 1})
    fs, root = get_fs(url, FAST.model_copy(update={"retry_budget_s": 1.0}))
    proxy.outage("503")
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as exc:
        commit_dir(fs, f"{root}/b", {"x.bin": b"lost"}, {"k": 2})
    assert time.monotonic() - t0 < 5
    msg = str(exc.value)
    assert "storage unavailable" in msg and f"{root}/b/_manifest.json" in msg
    assert "storage.retry_budget_s=1.0" in msg and "injected by FaultProxy" in msg  # the 503 body
    proxy.heal()
    manifest = read_manifest(fs, f"{root}/a")
    assert read_verified(fs, f"{root}/a", "x.bin", manifest) == b"committed" * 100
    assert not fs.exists(f"{root}/b/_manifest.json")  # the failed commit never became visible


def test_permanent_errors_are_not_retried(proxy):
    fs, root = get_fs(_url("missing"), FAST)
    before = proxy.requests
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{root}/nope")
    assert proxy.requests - before == 1


def test_a_corrupted_object_is_reported_with_its_path(proxy):
    fs, root = get_fs(_url("corrupt"), FAST)
    rollouts.write_step(fs, root, 1, rollouts.to_table(_rows(1)), {})
    shard = f"{rollouts.step_path(root, 1)}/part-00000.arrow"
    data = bytearray(fs.cat_file(shard))
    data[100] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(CorruptError) as exc:
        rollouts.read_step(fs, root, 1)
    assert shard in str(exc.value)
    manifest = f"{rollouts.step_path(root, 1)}/_manifest.json"
    m = json.loads(fs.cat_file(manifest))
    m["rows"] += 1  # valid JSON, wrong content
    fs.pipe_file(manifest, json.dumps(m).encode())
    with pytest.raises(CorruptError, match="manifest checksum mismatch") as exc:
        rollouts.read_step(fs, root, 1)
    assert manifest in str(exc.value)


def test_secrets_in_storage_options_are_refused():
    from config.loader import ConfigError, load_run_config

    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        load_run_config([], [("storage.options.secret", "x")])
    with pytest.raises(ConfigError, match="must not carry user:password"):
        load_run_config([], [("storage.endpoint_url", "http://ak:sk@127.0.0.1:9000")])
    with pytest.raises(ConfigError, match="keep_last_weights >= 4"):
        load_run_config([], [("storage.keep_last_weights", "3")])


# ---------------------------------------------------------------------------------------------------
# Whole runs through the fault proxy


def _cli(out: str, cwd: Path, api_url: str, *extra: str, env_extra: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "rollflow.cli", "rl"]
    for p in PROFILES:
        cmd += ["@", str(p)]
    cmd += ["--output-dir", out, "--overwrite", *extra]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env_extra or {})}
    env["PREFECT_API_URL"] = api_url  # the session's Prefect API: no temporary one per command
    env.pop(sfs.CONFIG_STORAGE_ENV, None)
    if wait:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


FAULT_FLAGS = ["--storage.timeout_s", "1.0", "--storage.retry_base_s", "0.05", "--storage.retry_max_backoff_s", "0.5"]


# `make test-long`: the soak's S3 segment (`make soak`) rides out longer outages in a longer run
@pytest.mark.slow
@pytest.mark.long
def test_a_run_survives_transient_storage_faults(proxy, tmp_path, prefect_api):
    out = _url("flaky-run")
    proxy.fail_every(25, "503", "reset", "503", "stall")
    proc = _cli(out, tmp_path, prefect_api, *FAULT_FLAGS, "--max-steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proxy.injected.get("503", 0) >= 2 and proxy.injected.get("reset", 0) >= 1, proxy.injected
    assert "retry 1" in proc.stdout + proc.stderr
    proxy.heal()
    fs, root = get_fs(out, FAST)
    assert rollouts.committed_rollout_steps(fs, root) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        rollouts.read_step(fs, root, step)  # every committed shard verifies


@pytest.mark.slow
def test_a_storage_outage_stops_the_run_with_a_clear_message_and_loses_nothing(proxy, tmp_path, prefect_api):
    out = _url("outage-run")
    fs, root = get_fs(out, FAST)
    run = _cli(
        out, tmp_path, prefect_api, *FAULT_FLAGS, "--storage.retry_budget_s", "2", "--max-steps", "40", wait=False
    )
    try:
        deadline = time.monotonic() + 120
        while len(rollouts.committed_rollout_steps(fs, root)) < 3:
            assert run.poll() is None, run.stdout.read()[-3000:] if run.stdout else ""
            assert time.monotonic() < deadline, "the run never committed 3 steps"
            time.sleep(0.2)
        proxy.outage("reset")
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    proxy.heal()
    assert run.returncode != 0
    assert "storage unavailable" in output and "storage.retry_budget_s=2.0" in output, output[-4000:]
    steps = rollouts.committed_rollout_steps(fs, root)
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1))
    for step in steps:
        table, manifest = rollouts.read_step(fs, root, step)  # committed before the outage: intact
        assert table.num_rows == manifest["rows"] > 0
