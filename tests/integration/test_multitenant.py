"""A shared deployment end to end (docs/multitenant.md): `rollflow shared up` on tiny-cpu's backbone, two tenant
runs with different environments and LoRA ranks attached to it at once through the real CLI and processes,
each run to completion with its own lake passing the resume audit, then `rollflow shared down`; and the shared
trainer SIGKILLed mid-run (a killed tenant: test_multitenant_lifecycle.py; the helpers: shared_deploy.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from shared_deploy import (
    TENANT,
    check_tenant,
    finish,
    shared_deployment,
    shut_down,
    step_times,
    tenant_runs,
    wait_until,
    write_profile,
)

MAX_STEPS = 4

pytestmark = pytest.mark.long


def _tenant_b(tmp_path: Path) -> Path:
    """Another environment and another rank than tenant a's (tiny-cpu-lora: both string tasks, rank 8)."""
    return write_profile(
        tmp_path / "tenant-b.toml",
        'run_name = "tenant-b"\n[model.lora]\nrank = 4\nalpha = 8.0\n'
        '[[envs]]\nname = "sort-letters"\nmin_chars = 3\nmax_chars = 6\n',
    )


def test_two_tenants_share_one_deployment_to_completion(tmp_path, prefect_api):
    with shared_deployment(tmp_path, prefect_api) as dep:
        t0 = time.monotonic()
        with tenant_runs(dep) as tenants:
            for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
                tenants[name] = dep.tenant(name, [*TENANT, *extra])
            finish(dep, tenants)
        t_tenants = time.monotonic() - t0
        for name in tenants:
            check_tenant(tmp_path / name, dep.record["backbone_sha256"], MAX_STEPS)
        assert list((dep.dir / "tenants").glob("*.json")) == []  # each run removed its record as it ended
        shut_down(dep)
        print(f"deployment up in {dep.up_s:.0f}s; two tenants x {MAX_STEPS} steps in {t_tenants:.0f}s")


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
    """The deployment restarts its trainer alone; every attached tenant's attempt fails and restarts from its own
    checkpoint (as a standalone run does when its trainer dies), and both finish with their lakes whole."""
    steps = 6
    with shared_deployment(tmp_path, prefect_api) as dep:
        with tenant_runs(dep) as tenants:
            for name, extra in (("tenant-a", []), ("tenant-b", [_tenant_b(tmp_path)])):
                tenants[name] = dep.tenant(name, [*TENANT, *extra], "--max-steps", str(steps))
            wait_until("tenant-a's step 3", lambda: len(step_times(tmp_path / "tenant-a")) >= 3, tenants, dep)
            os.kill(_shared_trainer_pid(dep.dir), signal.SIGKILL)
            finish(dep, tenants)
        for name in tenants:
            check_tenant(tmp_path / name, dep.record["backbone_sha256"], steps)
        assert json.loads((dep.dir / "shared_state.json").read_text())["restarts"] == {"inference": 0, "trainer": 1}
        assert json.loads((tmp_path / "tenant-a" / "state.json").read_text())["attempts"] >= 2  # restarted
        shut_down(dep)
