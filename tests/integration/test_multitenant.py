"""A shared deployment end to end (docs/multitenant.md): `rollflow shared up` on tiny-cpu's backbone, two tenant
runs with different environments and LoRA ranks attached to it at once through the real CLI and processes,
each run to completion with its own lake passing the resume audit, then `rollflow shared down`; and a tenant
SIGKILLed mid-run and resumed onto the deployment while the other trains on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, cli_argv, cli_env, descendants, processes_mentioning, start_cli
from test_resume import _assert_nothing_lost_or_duplicated, _trained_steps, _wait_gone

from storage.fs import get_fs, read_manifest

BASE = [ROOT / "profiles" / "tiny-cpu.toml", ROOT / "profiles" / "tiny-cpu-shared.toml"]
SHORT = ROOT / "tests" / "profiles" / "shared-short.toml"
TENANT = [ROOT / "profiles" / "tiny-cpu-lora.toml", ROOT / "tests" / "profiles" / "tenant-short.toml"]
MAX_STEPS = 4

pytestmark = pytest.mark.long


def _args(profiles: list[Path]) -> list[str]:
    return [t for p in profiles for t in ("@", str(p))]


def _wait_up(deploy: Path, cli: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> dict:
    """Until the deployment says up (the warm-up published the backbone, both processes launched)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert cli.poll() is None, log.read_text()[-4000:]
        try:
            state = json.loads((deploy / "shared_state.json").read_text())
        except (FileNotFoundError, ValueError):
            state = {}
        if state.get("state") == "up":
            return state
        time.sleep(0.5)
    raise AssertionError(f"the deployment was not up in {timeout_s}s:\n" + log.read_text()[-4000:])


def _tenant_b(tmp_path: Path) -> Path:
    """Another environment and another rank than tenant a's (tiny-cpu-lora: both string tasks, rank 8)."""
    profile = tmp_path / "tenant-b.toml"
    profile.write_text(
        'run_name = "tenant-b"\n[model.lora]\nrank = 4\nalpha = 8.0\n'
        '[[envs]]\nname = "sort-letters"\nmin_chars = 3\nmax_chars = 6\n'
    )
    return profile


def _check_tenant(out: Path, backbone_sha: str, max_steps: int = MAX_STEPS) -> None:
    _assert_nothing_lost_or_duplicated(out, max_steps, {})
    assert json.loads((out / "state.json").read_text())["status"] == "finished"
    fs, root = get_fs(str(out))
    version0 = read_manifest(fs, f"{root}/weights/step=000000")
    assert version0["model_sha256"] == backbone_sha  # the backbone's checked copy
    last = read_manifest(fs, f"{root}/weights/step={max_steps:06d}")
    assert last["encoding"] == "lora" and last["lora_base"]["model_sha256"] == backbone_sha
    assert last["lora_base"]["path"] == "weights/step=000000"  # a base inside the tenant's own directory
    status = json.loads((out / "shared_trainer.json").read_text())
    assert status["state"] == "finished" and status["step"] == max_steps and status["trainer_s"] > 0


def test_two_tenants_share_one_deployment_to_completion(tmp_path, prefect_api):
    deploy, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir()
    t0 = time.monotonic()
    up = start_cli(
        tmp_path, logs / "up.log", prefect_api, "shared", "up", *_args([*BASE, SHORT]), "--deploy-dir", str(deploy)
    )
    tenants = {}
    try:
        _wait_up(deploy, up, logs / "up.log")
        t_up = time.monotonic() - t0
        record = json.loads((deploy / "deployment.json").read_text())
        for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
            argv = ["rl", *_args([*TENANT, *extra]), "--output-dir", str(tmp_path / name)]
            tenants[name] = start_cli(
                tmp_path, logs / f"{name}.log", prefect_api, *argv, "--tenant-of", str(deploy), "--tenant", name
            )
        for name, cli in tenants.items():
            rc = cli.wait(timeout=600)
            assert rc == 0, (logs / f"{name}.log").read_text()[-4000:]
        t_tenants = time.monotonic() - t0 - t_up
        for name in tenants:
            _check_tenant(tmp_path / name, record["backbone_sha256"])
        assert list((deploy / "tenants").glob("*.json")) == []  # each run removed its record as it ended
        down = subprocess.run(
            cli_argv("shared", "down", str(deploy)),
            env=cli_env(prefect_api),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0 and json.loads(down.stdout)["state"] == "down", down.stdout + down.stderr
        assert up.wait(timeout=60) == 0, (logs / "up.log").read_text()[-4000:]
        print(f"deployment up in {t_up:.0f}s; two tenants x {MAX_STEPS} steps in {t_tenants:.0f}s")
    finally:
        for cli in [up, *tenants.values()]:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
    deadline = time.monotonic() + 30
    while processes_mentioning(str(deploy)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(deploy)) == [], "the shared processes outlived `shared down`"


def _down(deploy: Path, up: subprocess.Popen, api: str, log: Path) -> None:
    down = subprocess.run(
        cli_argv("shared", "down", str(deploy)), env=cli_env(api), capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0 and json.loads(down.stdout)["state"] == "down", down.stdout + down.stderr
    assert up.wait(timeout=60) == 0, log.read_text()[-4000:]


def _wait_trained(out: Path, step: int, cli: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _trained_steps(out) < step:
        assert cli.poll() is None and time.monotonic() < deadline, f"{out.name}: no step {step} in {timeout_s}s"
        time.sleep(0.1)


def test_a_killed_tenant_resumes_onto_the_deployment_while_another_trains_on(tmp_path, prefect_api):
    deploy, logs, steps = tmp_path / "shared", tmp_path / "logs", 8
    logs.mkdir()
    up = start_cli(
        tmp_path, logs / "up.log", prefect_api, "shared", "up", *_args([*BASE, SHORT]), "--deploy-dir", str(deploy)
    )
    clis: dict[str, subprocess.Popen] = {}
    try:
        _wait_up(deploy, up, logs / "up.log")
        record = json.loads((deploy / "deployment.json").read_text())
        for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
            argv = ["rl", *_args([*TENANT, *extra]), "--output-dir", str(tmp_path / name), "--max-steps", str(steps)]
            clis[name] = start_cli(
                tmp_path, logs / f"{name}.log", prefect_api, *argv, "--tenant-of", str(deploy), "--tenant", name
            )
        b, a = tmp_path / "tenant-b", tmp_path / "tenant-a"
        _wait_trained(b, 3, clis["tenant-b"])
        for pid in [clis["tenant-b"].pid, *descendants(clis["tenant-b"].pid)]:
            os.kill(pid, signal.SIGKILL)  # the flow and its orchestrator: nothing of b's runs any more
        clis["tenant-b"].wait()
        _wait_gone(b)
        assert (deploy / "tenants" / "tenant-b.json").exists()  # a killed run's record stays until its resume
        before = _trained_steps(a)
        _wait_trained(a, min(before + 2, steps), clis["tenant-a"])  # a trains on while b is dead
        resume = ["resume", str(b), "--tenant-of", str(deploy), "--tenant", "tenant-b"]
        clis["tenant-b"] = start_cli(tmp_path, logs / "tenant-b.log", prefect_api, *resume)
        for name, cli in clis.items():
            assert cli.wait(timeout=600) == 0, (logs / f"{name}.log").read_text()[-4000:]
        for name in clis:
            _check_tenant(tmp_path / name, record["backbone_sha256"], steps)
        state = json.loads((b / "state.json").read_text())
        assert len(state["resumes"]) == 1 and state["attempts"] >= 2
        assert list((deploy / "tenants").glob("*.json")) == []
        _down(deploy, up, prefect_api, logs / "up.log")
    finally:
        for cli in [up, *clis.values()]:
            if cli.poll() is None:
                cli.kill()
                cli.wait()


def _shared_trainer_pid(deploy: Path) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "engines.trainer.shared" in cmd and str(deploy) in cmd:
            return int(pid)
    raise AssertionError("no shared trainer process")


def test_a_killed_shared_trainer_is_restarted_and_its_tenants_restart_from_their_checkpoints(tmp_path, prefect_api):
    deploy, logs, steps = tmp_path / "shared", tmp_path / "logs", 6
    logs.mkdir()
    up = start_cli(
        tmp_path, logs / "up.log", prefect_api, "shared", "up", *_args([*BASE, SHORT]), "--deploy-dir", str(deploy)
    )
    clis: dict[str, subprocess.Popen] = {}
    try:
        _wait_up(deploy, up, logs / "up.log")
        record = json.loads((deploy / "deployment.json").read_text())
        for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
            argv = ["rl", *_args([*TENANT, *extra]), "--output-dir", str(tmp_path / name), "--max-steps", str(steps)]
            clis[name] = start_cli(
                tmp_path, logs / f"{name}.log", prefect_api, *argv, "--tenant-of", str(deploy), "--tenant", name
            )
        _wait_trained(tmp_path / "tenant-a", 3, clis["tenant-a"])
        os.kill(_shared_trainer_pid(deploy), signal.SIGKILL)
        for name, cli in clis.items():
            assert cli.wait(timeout=600) == 0, (logs / f"{name}.log").read_text()[-4000:]
        for name in clis:
            _check_tenant(tmp_path / name, record["backbone_sha256"], steps)
        assert json.loads((deploy / "shared_state.json").read_text())["restarts"] == {"inference": 0, "trainer": 1}
        assert json.loads((tmp_path / "tenant-a" / "state.json").read_text())["attempts"] >= 2  # restarted
        _down(deploy, up, prefect_api, logs / "up.log")
    finally:
        for cli in [up, *clis.values()]:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
