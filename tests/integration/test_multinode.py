"""A multi-node run for real, on the namespace cluster of infra/slurm/netns.sh (3 nodes, each a network, UTS and
mount namespace with its own slurmd): `rollflow submit` of tests/profiles/netns-3node.toml places inference on
rfnode1, the 2-rank FSDP2 trainer (one torchrun agent per node, c10d rendezvous and gloo over the namespaces'
network) and the orchestrator on rfnode2 and rfnode3. Then node loss: a trainer node's every process killed,
Slurm's requeue, the run resumed; both audited (tests/soak/audit.py). The node-loss run is tests/soak/multinode.py's."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.soak.audit import audit_run
from tests.soak.multinode import LOSS_BUDGET_S, cluster, node_loss_run, squeue, submit, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def netns_cluster():
    if os.geteuid() != 0:
        pytest.skip("network namespaces and Slurm daemons need root")
    if shutil.which("slurmd") is None or shutil.which("ip") is None:
        pytest.skip("no slurmd or ip: infra/slurm/up.sh installs Slurm")
    yield cluster("up", "3")
    cluster("down")


@pytest.mark.long  # ~60-70 s on 2 cores
def test_a_three_node_run_places_components_on_their_nodes_and_passes_the_audit(netns_cluster, tmp_path):
    out = tmp_path / "run"
    job_id = submit(out, max_steps=6)
    wait_until(f"Slurm job {job_id} done", lambda: not squeue(job_id), 300, every_s=1)
    text = (out / "logs" / f"slurm-{job_id}.out").read_text(errors="replace")
    assert "inference on rfnode1, orchestrator on rfnode2, trainer on rfnode2,rfnode3" in text
    assert re.search(r"\[inference\] serving \S+ \(embedded\) on rfnode1:\d+", text), "the engine must bind rfnode1"
    assert "--nodelist=rfnode2,rfnode3" in text and "--rdzv-endpoint rfnode2:" in text
    assert audit_run(out, 6, {}) == []


@pytest.mark.long  # ~3.5 min: Slurm holds a requeued job ~2 min before it starts it again
def test_a_lost_trainer_node_is_requeued_by_slurm_and_the_run_resumes_losing_nothing(netns_cluster, tmp_path):
    result = node_loss_run(tmp_path, seed=1, losses=1, max_steps=10)
    assert result.problems == []
    (fault,) = result.faults
    assert fault.kind == "node:loss" and fault.recover_s is not None and fault.recover_s < LOSS_BUDGET_S
    print(f"node loss: {fault.note}, recovered in {fault.recover_s}s, {fault.rolled_back} step(s) rolled back")
