"""storage/fs.py without a network: which errors are transient, the retry budget, manifest self-checksums,
and committed-step discovery from one listing."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from config.storage import StorageConfig
from storage.fs import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    CorruptError,
    StorageUnavailable,
    call_with_retry,
    commit_dir,
    committed_steps,
    get_fs,
    is_transient,
    read_manifest,
)

FAST = StorageConfig(retry_base_s=0.001, retry_max_backoff_s=0.01, retry_budget_s=0.5, retry_max_attempts=50)


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def _wrapped(cause: BaseException) -> OSError:
    """What s3fs raises: a plain OSError whose cause is the botocore error."""
    try:
        raise OSError(16, "Service Unavailable") from cause
    except OSError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        _client_error(503, "ServiceUnavailable"),
        _client_error(500, "InternalError"),
        _client_error(400, "RequestTimeout"),
        _client_error(429, "TooManyRequests"),
        _client_error(503, "SlowDown"),
        _wrapped(_client_error(503, "503")),
        ConnectionResetError(),
        TimeoutError(),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ],
)
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("k"),
        PermissionError("denied"),
        _client_error(403, "AccessDenied"),
        _client_error(404, "NoSuchBucket"),
        _wrapped(_client_error(400, "InvalidArgument")),
        ValueError("bad"),
    ],
)
def test_permanent(exc):
    assert not is_transient(exc)


def test_transient_errors_are_retried_until_success():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert call_with_retry(flaky, "cat_file s3://b/k", FAST) == "ok"
    assert len(calls) == 3


def test_permanent_errors_fail_at_once():
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://b/k")

    with pytest.raises(FileNotFoundError):
        call_with_retry(missing, "cat_file s3://b/k", FAST)
    assert len(calls) == 1


def test_the_budget_bounds_an_outage_and_the_message_names_op_path_and_budget():
    def down():
        raise _wrapped(_client_error(503, "503"))

    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as exc:
        call_with_retry(down, "pipe_file s3://b/run/rollouts/step=000003/part-00000.arrow", FAST)
    assert time.monotonic() - t0 < 1.0
    msg = str(exc.value)
    assert "pipe_file s3://b/run/rollouts/step=000003/part-00000.arrow" in msg
    assert "storage.retry_budget_s=0.5" in msg and "Service Unavailable" in msg and "intact" in msg


def test_attempt_limit_and_masked_credentials():
    s = StorageConfig(retry_base_s=0.001, retry_max_backoff_s=0.001, retry_budget_s=60, retry_max_attempts=3)
    calls = []

    def down():
        calls.append(1)
        raise ConnectionRefusedError("cannot reach http://AKIAXXX:hunter2@minio:9000/b")

    with pytest.raises(StorageUnavailable) as exc:
        call_with_retry(down, "exists s3://b/k", s)
    assert len(calls) == 3 and "3 time(s)" in str(exc.value)
    assert "hunter2" not in str(exc.value) and "://***@minio:9000" in str(exc.value)


def test_a_retried_delete_that_already_happened_counts_as_done():
    calls = []

    def rm():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError()  # the DELETE went through; its answer was lost
        raise FileNotFoundError("gone")

    assert call_with_retry(rm, "rm s3://b/k", FAST, idempotent_rm=True) is None


def test_manifest_carries_and_checks_its_own_checksum(tmp_path):
    fs, root = get_fs(str(tmp_path))
    manifest = commit_dir(fs, f"{root}/d", {"a.bin": b"abc"}, {"rows": 3})
    assert read_manifest(fs, f"{root}/d") == manifest
    path = Path(root) / "d" / MANIFEST
    data = json.loads(path.read_text())
    data["rows"] = 4
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptError, match=f"{path}: manifest checksum mismatch"):
        read_manifest(fs, f"{root}/d")
    path.write_text(json.dumps({"rows": 4}))
    with pytest.raises(CorruptError, match="no 'files' table"):
        read_manifest(fs, f"{root}/d")


def test_a_manifest_with_integer_keys_reads_back(tmp_path):
    """A step whose samples came from versions 9 and 10: JSON sorts the written keys as text ("10" < "9")."""
    fs, root = get_fs(str(tmp_path))
    commit_dir(fs, f"{root}/d", {"a.bin": b"abc"}, {"versions": {9: 208, 10: 48}})
    assert read_manifest(fs, f"{root}/d")["versions"] == {"9": 208, "10": 48}
    path = Path(root) / "d" / MANIFEST  # as written before the fix: the digest over numerically sorted keys
    data = json.loads(path.read_text())
    body = {"files": data["files"], "versions": {9: 208, 10: 48}}
    data[MANIFEST_CHECKSUM] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    path.write_text(json.dumps(data))
    assert read_manifest(fs, f"{root}/d")["versions"] == {"9": 208, "10": 48}
    data["versions"]["9"] = 207
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptError, match="manifest checksum mismatch"):
        read_manifest(fs, f"{root}/d")


def test_committed_steps_from_one_listing(tmp_path):
    fs, root = get_fs(str(tmp_path))
    for step in (3, 1, 12):
        commit_dir(fs, f"{root}/ck/step={step:06d}/trainer", {"m": b"x"}, {})
    commit_dir(fs, f"{root}/ck/step=000005/orchestrator", {"m": b"x"}, {})  # no trainer checkpoint at 5
    (tmp_path / "ck" / "step=000007" / "trainer").mkdir(parents=True)  # being written: no manifest
    (tmp_path / "ck" / "notes").mkdir()
    assert committed_steps(fs, f"{root}/ck", "trainer") == [1, 3, 12]
    assert committed_steps(fs, f"{root}/ck", "orchestrator") == [5]
    assert committed_steps(fs, f"{root}/ck") == []
    assert committed_steps(fs, f"{root}/missing") == []
