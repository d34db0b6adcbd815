"""The run side of a shared deployment that stands alone (docs/multitenant.md): a tenant profile's checks at load,
the backbone copy and its hash check, the tenant record, the shared-trainer status watch, the CLI's dry runs and
`shared status|down`, and the orchestrator's tenant requests against a real loopback HTTP server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from config.loader import load_run_config
from config.run import RunConfig
from config.stall import StallConfig
from config.tenant import DeploymentRecord, SharedTrainerStatus
from engines.orchestrator.loop import WeightSync
from engines.orchestrator.tenant import TenantClient, wait_registered
from rollflow.cli import main
from runtime.process import ComponentFailed, ComponentStalled
from runtime.rundir import write_run_config
from runtime.shared import write_state
from runtime.tenancy import (
    STATUS_FILE,
    Registration,
    SharedTarget,
    SharedTrainerWatch,
    TenantError,
    check_slot,
    copy_backbone,
    retire,
    tenant_problems,
)
from storage import weights
from storage.fs import CorruptError, commit_dir, get_fs, read_manifest
from storage.tenants import read_tenants, write_deployment

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "profiles" / "tiny-cpu-lora.toml"


def _tenant_cfg(out: Path, **overrides) -> RunConfig:
    return load_run_config([LORA], [("output_dir", str(out)), *overrides.items()])


def _deployment(tmp_path: Path, max_tenants: int = 2, max_lora_rank: int = 8) -> tuple[Path, DeploymentRecord]:
    """A deployment directory as `rollflow shared up` leaves it, its backbone a small real publication."""
    d = tmp_path / "deploy"
    base = load_run_config([LORA], [("output_dir", str(d))])
    base.model.lora = None
    write_run_config(base, "base-run")
    fs, root = get_fs(str(d))
    weights.publish(fs, root, 0, {"w": torch.arange(6.0)}, {"config.json": b"{}"})
    record = DeploymentRecord(
        backbone_dir=f"{d}/weights/step=000000",
        backbone_sha256=read_manifest(fs, weights.version_dir(root, 0))["model_sha256"],
        inference_url="http://127.0.0.1:9",
        max_tenants=max_tenants,
        max_lora_rank=max_lora_rank,
    )
    write_deployment(str(d), record)
    return d, record


def test_a_tenant_profile_is_refused_naming_each_key_and_its_valid_value(tmp_path):
    d, record = _deployment(tmp_path)
    backbone = load_run_config([LORA], []).model.model_copy(update={"lora": None})
    assert tenant_problems(_tenant_cfg(tmp_path / "t"), backbone, record) == []
    bad = _tenant_cfg(
        tmp_path / "t",
        **{"model.lora.rank": "16", "model.hidden_size": "128", "inference.backend": "vllm"},
    )
    problems = tenant_problems(bad, backbone, record)
    assert any("model.lora.rank = 16" in p and "rank <= 8" in p for p in problems), problems
    assert any("model.hidden_size = 128" in p and "192" in p for p in problems), problems
    assert any("inference.backend = 'vllm'" in p and "'embedded'" in p for p in problems), problems
    no_lora = _tenant_cfg(tmp_path / "t")
    no_lora.model.lora = None
    assert any(p.startswith("model.lora is not set") for p in tenant_problems(no_lora, backbone, record))


def test_the_cli_refuses_a_bad_tenant_profile_with_exit_code_2(tmp_path, capsys):
    d, _ = _deployment(tmp_path)
    argv = ["rl", "@", str(LORA), "--output-dir", str(tmp_path / "t"), "--tenant-of", str(d), "--dry-run"]
    assert main([*argv, "--model.lora.rank", "32"]) == 2
    err = capsys.readouterr().err
    assert "model.lora.rank = 32" in err and "shared.max_lora_rank = 8" in err
    assert main(["rl", "@", str(LORA), "--tenant-of", str(tmp_path / "nowhere"), "--dry-run"]) == 2
    assert "no shared deployment here" in capsys.readouterr().err


def test_a_tenant_dry_run_shows_what_it_would_launch_and_registers_nothing(tmp_path, capsys):
    d, record = _deployment(tmp_path)
    out = tmp_path / "t"
    argv = ["rl", "@", str(LORA), "--output-dir", str(out), "--tenant-of", str(d), "--tenant", "alice", "--dry-run"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tenant"] == "alice" and plan["inference_url"] == record.inference_url
    assert "-m engines.orchestrator --config" in plan["launch"]["orchestrator"]
    assert plan["record"].endswith("tenants/alice.json")
    orch = json.loads((out / "config" / "orchestrator.json").read_text())
    assert orch["tenant"] == "alice" and orch["inference_url"] == record.inference_url
    assert (out / "config" / "trainer.json").exists() and not (out / "config" / "inference.json").exists()
    assert read_tenants(str(d)) == ({}, []) and not (out / "weights").exists()


def test_the_backbone_copy_is_checked_against_the_deployment_hash(tmp_path):
    d, record = _deployment(tmp_path)
    fs, root = get_fs(str(tmp_path / "t"))
    assert copy_backbone(str(d), record, fs, root) is True
    src, dst = d / "weights" / "step=000000", tmp_path / "t" / "weights" / "step=000000"
    assert (dst / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert read_manifest(fs, str(dst))["model_sha256"] == record.backbone_sha256
    assert copy_backbone(str(d), record, fs, root) is False  # present: kept
    other = record.model_copy(update={"backbone_sha256": "0" * 64})
    with pytest.raises(TenantError, match="another backbone"):
        copy_backbone(str(d), other, fs, root)  # T's version 0 is not this deployment's backbone
    fs2, root2 = get_fs(str(tmp_path / "t2"))
    with pytest.raises(TenantError, match="not the deployment's backbone_sha256"):
        copy_backbone(str(d), other, fs2, root2)
    (src / "config.json").write_bytes(b"{tampered}")
    with pytest.raises(CorruptError):
        copy_backbone(str(d), record, fs2, root2)
    assert not (tmp_path / "t2" / "weights").exists()


def test_the_record_holds_the_token_hash_and_is_removed_only_by_its_run(tmp_path):
    d, record = _deployment(tmp_path, max_tenants=1)
    target = SharedTarget(str(d), record, "alice")
    mine = Registration(target, str(tmp_path / "a"), "run-a")
    assert mine.attach(3, 2) == 3
    token = mine.token
    (rec,), skipped = read_tenants(str(d))[0].values(), read_tenants(str(d))[1]
    assert skipped == [] and (rec.attempt, rec.resume_step, rec.output_dir) == (3, 2, str(tmp_path / "a"))
    assert rec.token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert token not in (d / "tenants" / "alice.json").read_text()
    with pytest.raises(TenantError, match="attached to .* by the run in"):
        check_slot(str(d), "alice", str(tmp_path / "b"), record)
    with pytest.raises(TenantError, match="max_tenants = 1"):
        check_slot(str(d), "bob", str(tmp_path / "b"), record)
    check_slot(str(d), "alice", str(tmp_path / "a"), record)  # its own record: a resume
    assert mine.attach(1, None) == 4  # above the record left behind: the shared processes follow it
    Registration(target, str(tmp_path / "b"), "run-b").detach()  # another run's: left alone
    assert "alice" in read_tenants(str(d))[0]
    mine.detach()
    assert read_tenants(str(d))[0] == {}


def _status(out: Path, **fields) -> None:
    (out / STATUS_FILE).write_text(SharedTrainerStatus(**fields).model_dump_json())


def test_the_shared_trainer_watch_ends_fails_and_stalls_the_attempt(tmp_path):
    now = [1000.0]
    fs, root = get_fs(str(tmp_path))
    stall = StallConfig(startup_s=30, trainer_s=10)
    watch = SharedTrainerWatch(fs, root, 2, stall, clock=lambda: now[0])
    assert watch.check() is False  # no report yet
    _status(tmp_path, attempt=1, state="finished", step=5, updated=now[0])
    assert watch.check() is False  # an older attempt's report is not this attempt's
    _status(tmp_path, attempt=2, state="waiting", step=1, updated=now[0])
    now[0] += 25
    assert watch.check() is False  # waiting on its rollouts: the orchestrator's stall watch judges that
    with pytest.raises(ComponentStalled, match="waiting"):
        watch.check(judge_waiting=True)
    _status(tmp_path, attempt=2, state="training", step=1, updated=now[0])
    now[0] += 9
    assert watch.check() is False
    now[0] += 2
    with pytest.raises(ComponentStalled, match="trainer_s = 10s"):
        watch.check()
    _status(tmp_path, attempt=2, state="failed", step=1, error="boom", updated=now[0])
    with pytest.raises(ComponentFailed, match="boom"):
        watch.check()
    _status(tmp_path, attempt=2, state="finished", step=3, updated=now[0])
    assert watch.check() is True
    late = SharedTrainerWatch(fs, str(tmp_path / "none"), 1, stall, clock=lambda: now[0])
    now[0] += 31
    with pytest.raises(ComponentStalled, match="did not report attempt 1"):
        late.check()


class _Engine(BaseHTTPRequestHandler):
    """A shared server's routes as a tenant sees them; records every request."""

    seen: list[tuple[str, str, dict, str]] = []
    tenants: dict[str, int] = {}

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(("GET", self.path, {}, self.headers.get("Authorization", "")))
        self._reply({"status": "ok", "policy_version": 7, "stats": {}, "tenants": dict(self.tenants)})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append(("POST", self.path, body, self.headers.get("Authorization", "")))
        if self.path == "/update_weights":
            self.tenants[body["tenant"]] = body["version"]
            self._reply({"policy_version": body["version"], "source": "filesystem", "load_s": 0.0, "apply_s": 0.0})
        else:
            self._reply({"ok": True})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engine():
    _Engine.seen, _Engine.tenants = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=5)


def test_the_orchestrator_speaks_as_its_tenant(engine, tmp_path):
    fs, root = get_fs(str(tmp_path))
    for version in (0, 1, 2):
        commit_dir(fs, weights.version_dir(root, version), {"x": b""}, {"version": version})

    async def go() -> WeightSync:
        async with TenantClient("alice", "secret", base_url=engine, timeout=5.0) as client:
            registering = asyncio.create_task(wait_registered(client, "alice", timeout_s=10))
            await asyncio.sleep(0.5)
            assert not registering.done()  # the server has not listed the tenant yet
            _Engine.tenants["alice"] = -1
            await asyncio.wait_for(registering, 5)
            await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            sync = WeightSync(client, fs, root, "secret", 0.1, tenant="alice")
            await sync.refresh()
            assert sync.engine_version == -1  # the tenant's version, not the server's policy_version 7
            await sync.push_latest()
            return sync

    sync = asyncio.run(go())
    assert sync.engine_version == 2 and _Engine.tenants == {"alice": 2}
    assert all(auth == "Bearer secret" for _, _, _, auth in _Engine.seen)
    (completion,) = [body for method, path, body, _ in _Engine.seen if path == "/v1/completions"]
    assert completion["model"] == "alice"
    (update,) = [body for method, path, body, _ in _Engine.seen if path == "/update_weights"]
    assert update == {"version": 2, "tenant": "alice"}


def test_registration_waits_are_bounded(engine):
    async def go() -> None:
        async with httpx.AsyncClient(base_url=engine) as client:
            await wait_registered(client, "nobody", timeout_s=0.5)

    with pytest.raises(TimeoutError, match="has not registered tenant 'nobody'"):
        asyncio.run(go())


def test_shared_status_and_down_without_a_supervisor(tmp_path, capsys):
    d, record = _deployment(tmp_path)
    Registration(SharedTarget(str(d), record, "alice"), str(tmp_path / "a"), "run-a").attach(1, None)
    (tmp_path / "a").mkdir()
    _status(tmp_path / "a", attempt=1, state="training", step=2, updated=1.0)
    assert main(["shared", "status", str(d)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["deployment"]["backbone_sha256"] == record.backbone_sha256
    assert status["tenants"]["alice"]["trainer"]["step"] == 2
    assert main(["shared", "down", str(d)]) == 0
    assert json.loads(capsys.readouterr().out)["running"] is False
    assert not (d / "shared.stop").exists()


def test_shared_up_refuses_a_profile_that_is_not_a_deployment_and_plans_one_that_is(tmp_path, capsys):
    assert main(["shared", "up", "@", str(LORA), "--deploy-dir", str(tmp_path / "d"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "[shared] is not set" in err and "model.lora is set" in err
    base = ["@", str(ROOT / "profiles" / "tiny-cpu.toml"), "@", str(ROOT / "profiles" / "tiny-cpu-shared.toml")]
    assert main(["shared", "up", *base, "--deploy-dir", str(tmp_path / "d"), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "-m engines.trainer --config" in plan["warmup"]  # no backbone yet: the warm-up publishes it
    assert plan["launch"]["trainer"].endswith(
        f"-m engines.trainer.shared --config {tmp_path}/d/config/shared_trainer.json"
    )
    assert plan["shared"]["max_lora_rank"] == 16 and not (tmp_path / "d").exists()


def test_a_new_attempt_waits_until_the_shared_trainer_let_the_previous_one_go(tmp_path):
    d, record = _deployment(tmp_path)
    target, out = SharedTarget(str(d), record, "alice"), str(tmp_path / "a")
    assert retire(target, out, timeout_s=5) is True  # no record: nothing to wait for
    Registration(target, out, "run-a").attach(1, None)
    write_state(str(d), "up")
    (d / STATUS_FILE).write_text(json.dumps({"updated": time.time(), "tenants": {"alice": {}}}))

    def trainer_polls() -> None:  # the shared trainer's next summary, after it dropped the removed record
        time.sleep(0.5)
        (d / STATUS_FILE).write_text(json.dumps({"updated": time.time(), "tenants": {}}))

    polls = threading.Thread(target=trainer_polls)
    t0 = time.monotonic()
    polls.start()
    assert retire(target, out, timeout_s=10) is True
    polls.join()
    assert 0.4 < time.monotonic() - t0 < 5 and read_tenants(str(d))[0] == {}
    Registration(target, out, "run-a").attach(2, None)
    write_state(str(d), "down")  # no trainer runs: nothing to wait for
    assert retire(target, out, timeout_s=10) is False and read_tenants(str(d))[0] == {}
