"""The trainer's torchrun argv (launch/torchrun.py): one process, one node, several nodes meeting under a
rendezvous id of their own run and attempt, as the `rl` flow renders it for each attempt."""

from __future__ import annotations

from config.run import RunConfig
from launch.torchrun import RDZV_ID_PLACEHOLDER, rdzv_id, torchrun_args


def test_one_process_and_one_node():
    assert torchrun_args(1) == [] and torchrun_args(1, ["a", "b"]) == []
    # one node: torch's standalone rendezvous (localhost, a free port and a random id of its own)
    assert torchrun_args(4, ["a"]) == ["-m", "engines.trainer.torchrun", "--standalone", "--nproc-per-node", "4"]


def test_several_nodes_meet_under_the_attempts_own_id():
    argv = torchrun_args(4, ["n1", "n2"], 29411, rdzv_id("sort-20261127-053800-ab12", 3))
    assert argv == [
        *("-m", "engines.trainer.torchrun", "--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29411"),
        *("--rdzv-id", "rollflow-sort-20261127-053800-ab12-a3"),
    ]
    assert torchrun_args(4, ["n1", "n2"])[-1] == RDZV_ID_PLACEHOLDER  # what --dry-run shows


def test_ids_differ_between_runs_and_attempts_and_stay_one_argument():
    ids = {rdzv_id(run, attempt) for run in ("a-1", "a-2") for attempt in (1, 2)}
    assert len(ids) == 4
    assert rdzv_id("x y/../$(z)", 1) == "rollflow-x_y_..___z_-a1"


def test_the_flow_renders_each_attempt_with_its_own_id():
    from flows.rl import Placement

    cfg = RunConfig.model_validate({"trainer": {"parallel": {"world_size": 4, "rdzv_port": 29500}}})
    placed = Placement({}, "i1", torchrun_args(4, ["t1", "t2"], 29500), [], ["t1", "t2"])
    first, second = (placed.for_attempt(cfg, "run-1", n).trainer_launcher for n in (1, 2))
    assert first[-1] == "rollflow-run-1-a1" and second[-1] == "rollflow-run-1-a2"
    assert first[:-1] == second[:-1] == placed.trainer_launcher[:-1]
    local = Placement({}, None, torchrun_args(4), [])
    assert local.for_attempt(cfg, "run-1", 1) is local  # --standalone: torch draws the id
