"""The soak's Slurm segment (tests/soak/slurm.py) as a test: one run under the real one-node Slurm through the
Slurm worker, preempted (SIGTERM to the job, requeued) and stopped at its walltime, each recovered, and the
resume audit passing. `make test-long`: 12 min 48 s here (160 steps at a load average of 5-7 from other work;
Slurm alone holds a requeued job 120 s before it runs it again)."""

from __future__ import annotations

import pytest
from test_slurm import slurm_cluster, slurm_worker  # noqa: F401 - fixtures

from tests.soak.slurm import segment

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_a_preempted_and_walltimed_slurm_run_recovers_and_passes_the_audit(tmp_path, prefect_api, slurm_worker):  # noqa: F811
    result = segment(tmp_path, seed=1, minutes=3, api=prefect_api, worker=slurm_worker)
    print(result.to_json())
    assert result.problems == [], result.problems
    kinds = [f.kind for f in result.faults]
    assert kinds == ["slurm:preempt", "slurm:walltime"], kinds
    for fault in result.faults:
        assert fault.recover_s is not None and 0 < fault.recover_s < 300, fault
        assert 0 <= fault.rolled_back <= 4, fault  # a checkpoint interval (2) and the steps in flight
