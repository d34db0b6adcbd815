"""A process writing for several runs in turn (the multi-tenant shared trainer) fences each run's writes with
that run's lease as captured when its attempt joined (storage/fence.py `capture`, `scoped`): once another flow
took the run over (a resume after a kill), the old attempt's writes there are refused, other paths unaffected."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from storage import fence
from storage.fs import get_fs, join, write_bytes_atomic, write_json
from storage.runstate import LEASE_FILE, Lease, LeaseLost


def _hold(fs, root: str, generation: int) -> None:
    lease = Lease(owner=f"owner-{generation}", host="h", pid=1, expires_at=0.0, generation=generation)
    write_json(fs, join(root, LEASE_FILE), asdict(lease))


def test_a_scoped_fence_refuses_a_taken_over_runs_writes_only(tmp_path):
    run, other = tmp_path / "tenant", tmp_path / "elsewhere"
    run.mkdir(), other.mkdir()
    fs, root = get_fs(str(run))
    _hold(fs, root, 1)
    held = fence.capture(fs, root)
    assert held is not None and held.generation == 1
    with fence.scoped(held):
        write_bytes_atomic(fs, join(root, "metrics.jsonl"), b"{}\n")  # still its lease: written
    _hold(fs, root, 2)  # the resume took the run over
    with fence.scoped(held):
        with pytest.raises(LeaseLost):
            write_bytes_atomic(fs, join(root, "metrics.jsonl"), b"stale\n")
        write_bytes_atomic(fs, str(other / "x"), b"1")  # not under that run: not its fence's business
    assert (run / "metrics.jsonl").read_bytes() == b"{}\n"
    write_bytes_atomic(fs, join(root, "metrics.jsonl"), b"new\n")  # outside the scope: the process's own fence
    assert fence.capture(fs, str(other)) is None  # no lease, nothing to fence
