"""A killed tenant attempt's leftover work never lands in its resumed run (docs/multitenant.md, "Tenants").

When a tenant run dies, the shared trainer still holds its attempt until a record with a higher attempt arrives,
and keeps training that attempt's committed rollouts. The resume rolls the run directory back to its checkpoint
first and writes the new record after; a step of the old attempt trained in between would land in the rolled-back
directory (a metrics row, a publication) and then be trained again by the new attempt. The test makes that window
certain: the shared trainer is stopped (SIGSTOP) while the old attempt has a committed, untrained rollout step,
the tenant is killed and resumed, and the trainer continues (SIGCONT) once the resume has rolled back. Without
fencing, that step landed (measured: the old attempt trained its step 3 after the rollback). With it (the shared
trainer writes a tenant's step under the lease the tenant's attempt held when it joined: storage/fence.py
`scoped`) the old attempt's write is refused, that attempt alone fails, and the shared trainer goes on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from shared_deploy import (
    TENANT,
    Deployment,
    check_tenant,
    kill_tree,
    shared_deployment,
    shut_down,
    step_times,
    wait_until,
    write_profile,
)
from test_resume import _committed_rollouts

pytestmark = pytest.mark.long
STEPS = 8


def _shared_trainer_pid(dep: Deployment) -> int:
    config = str(dep.dir / "config" / "shared_trainer.json")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if config in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return int(pid)
        except OSError:
            continue
    raise AssertionError("no shared trainer process")


def test_a_killed_attempts_pending_step_never_lands_after_its_resume_rolled_back(tmp_path, prefect_api):
    # no checkpoint before the end: the resume starts from version 0 and rolls back every trained step
    profile = write_profile(tmp_path / "a.toml", f"max_steps = {STEPS}\n[checkpoint]\ninterval = 100\n")
    out = tmp_path / "tenant-a"
    with shared_deployment(tmp_path, prefect_api) as dep:
        cli = dep.tenant("tenant-a", [*TENANT, profile])
        try:
            wait_until("A trained 2 steps", lambda: len(step_times(out)) >= 2, {"tenant-a": cli}, dep)
            trainer = _shared_trainer_pid(dep)
            os.kill(trainer, signal.SIGSTOP)
            try:
                trained = len(step_times(out))
                wait_until("A's next rollouts committed", lambda: max(_committed_rollouts(out)) > trained,
                            {"tenant-a": cli}, dep, 120)  # fmt: skip
                kill_tree(cli, out)
                snapshots = _committed_rollouts(out)
                before = dep.log("tenant-a").read_text().count("rolled back")
                cli = dep.resume("tenant-a")
                wait_until("the resume rolled back",
                            lambda: dep.log("tenant-a").read_text().count("rolled back") > before,
                            {"tenant-a": cli}, dep, 180)  # fmt: skip
            finally:
                os.kill(trainer, signal.SIGCONT)
            assert cli.wait(timeout=600) == 0, dep.tail("tenant-a")
        finally:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGKILL)
                cli.wait()
        log = (dep.dir / "logs" / "shared-trainer.log").read_text()
        assert "tenant tenant-a attempt 1 failed: LeaseLost" in log  # its pending step was refused, not written
        assert _shared_trainer_pid(dep) == trainer  # by the step alone: the shared trainer went on (no restart)
        check_tenant(out, dep.record["backbone_sha256"], STEPS, snapshots)
        shut_down(dep)
