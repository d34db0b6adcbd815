"""The shortened soak (`make test-long`; `make soak` runs the full one): the driver in --quick mode (one fault of
each class that fits a local run: a SIGKILL, a SIGSTOP past the stall timeout, a corrupt newest
shard/publication/checkpoint, a second resume, a full tmpfs) against a real tiny run, and the audit must pass. The
S3 outage, MoE and multi-turn segments run in `make soak` only (each costs a run of its own). Measured on the
shared 2-core machine (load 4-8 from other work) with 60 steps: 176 s and 210 s for the pytest call, of which the
soaked run itself 147-186 s."""

from __future__ import annotations

import os

import pytest

from tests.soak.segments import LOCAL_KINDS, dense_local

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 150-210 s: over make test's budget


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_quick_soak_recovers_every_fault_and_passes_the_audit(tmp_path, prefect_api):
    result = dense_local(tmp_path, seed=3, minutes=5.0, quick=True)
    print(result.to_json())
    assert result.problems == []
    classes = {k.split(":")[0] for k in LOCAL_KINDS}
    assert {f.kind.split(":")[0] for f in result.faults} == classes, [f.kind for f in result.faults]
    assert all(f.recover_s is not None and f.recover_s < 300 for f in result.faults)
    second = [f for f in result.faults if f.kind == "resume:second"]
    assert second and second[0].note.startswith("refused"), second  # never two writers
