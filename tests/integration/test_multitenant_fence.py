"""A killed tenant attempt's leftover work never lands in its resumed run (docs/multitenant.md, "Tenants").

When a tenant run dies, the shared trainer still holds its attempt and would keep training that attempt's committed
rollouts; a step of the old attempt trained after the resume rolled the run directory back would land there (a
metrics row, a publication) and then be trained again by the new attempt (measured before the fence: the old
attempt trained its step 3 after the rollback). Two defences: the resume first removes the old record and waits
(restart.stall.trainer_s) for the trainer to let the attempt go (runtime/tenancy.py `retire`), and the trainer
writes a tenant's step under the lease the attempt held when it joined (storage/fence.py `scoped`), so a late
write is refused. The test stops the shared trainer (SIGSTOP) while the old attempt has a committed, untrained
rollout step, kills and resumes the tenant (the wait runs out: 20 s here) and continues the trainer once the resume
has rolled back; the resumed run must pass the audit against the lake as the kill left it, and the shared trainer
must go on without a restart."""

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
    # no checkpoint before the end: the resume starts from version 0 and rolls back every trained step. The
    # resume first waits (restart.stall.trainer_s) for the stopped shared trainer to let the old attempt go
    # (runtime/tenancy.py `retire`); 20 s here, then it rolls back anyway: the case the lease fence must cover.
    profile = write_profile(
        tmp_path / "a.toml", f"max_steps = {STEPS}\n[checkpoint]\ninterval = 100\n[restart.stall]\ntrainer_s = 20\n"
    )
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
        # Two defences, whichever the timing meets: the trainer, continued, reads the records first and lets attempt 1
        # go before stepping it (runtime/tenancy.py `retire` removed its record), or it steps it and the write is
        # refused under the lease that attempt joined with (storage/fence.py). Either way nothing of attempt 1
        # lands after the rollback: check_tenant's audit below, against the lake as the kill left it.
        assert "tenant tenant-a attempt 1 failed: LeaseLost" in log or "tenant tenant-a attempt 1 left" in log
        assert _shared_trainer_pid(dep) == trainer  # by the step alone: the shared trainer went on (no restart)
        check_tenant(out, dep.record["backbone_sha256"], STEPS, snapshots)
        shut_down(dep)
