"""The soak's ranks segment (tests/soak/ranks.py) as a test: a 2-rank FSDP2 trainer run with one rank
SIGKILLed and one SIGSTOPped (a hung collective the stall watch must end), each restarted by the flow, and
the resume audit passing. `make test-long`: 2 min 39-44 s here (14 steps; the stopped rank took 49-54 s to recover,
20 s of it the stall timeout; the killed one 17-26 s)."""

from __future__ import annotations

import pytest

from tests.soak.ranks import KINDS, segment

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_killed_and_stopped_trainer_ranks_are_restarted_and_the_audit_passes(tmp_path, prefect_api):
    result = segment(tmp_path, seed=1, minutes=2, api=prefect_api)
    print(result.to_json())
    assert result.problems == [], result.problems
    assert sorted({f.kind for f in result.faults}) == sorted(KINDS), result.faults
    for fault in result.faults:
        # a stall timeout (20 s) or a crash, then torchrun and its ranks again, then a step
        assert fault.recover_s is not None and 0 < fault.recover_s < 180, fault
        assert 0 <= fault.rolled_back <= 4, fault  # a checkpoint interval (2) and the steps in flight
