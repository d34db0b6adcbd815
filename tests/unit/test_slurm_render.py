"""The rendered sbatch script and srun placement for 1, 2 and 4-node profiles, against golden files
(tests/unit/golden/; ROLLFLOW_UPDATE_GOLDEN=1 rewrites them), and the deployment section's validation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from config.loader import ConfigError, load_run_config
from launch.slurm import PlacementError, place, render_placement, render_sbatch
from launch.torchrun import RDZV_ID_PLACEHOLDER

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
PROFILES = {
    1: [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/slurm-short.toml"],
    2: [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/slurm-2node.toml"],
    4: [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/profiles/slurm-4node.toml"],
}
COMMAND = "/opt/rollflow/.venv/bin/python -m prefect.engine"
ENV = {"PREFECT_API_URL": "http://login1:4200/api", "PREFECT__FLOW_RUN_ID": "0b5d", "QUOTED": "a b'c"}


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("ROLLFLOW_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with ROLLFLOW_UPDATE_GOLDEN=1 if intended"


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_rendered_job_matches_golden(nodes: int) -> None:
    cfg = load_run_config(PROFILES[nodes])
    dep = cfg.placement
    assert dep.nodes == nodes
    script = render_sbatch(dep.slurm, dep.nodes, f"rollflow-{nodes}n", COMMAND, ENV, "/scratch/logs/slurm-%j.out")
    _check(f"slurm-{nodes}node.sbatch", script)
    hosts = [f"gpu{i:02d}" for i in range(1, nodes + 1)]
    parallel = cfg.trainer.parallel
    placement = {"symbolic": render_placement(dep, parallel), "hosts": render_placement(dep, parallel, hosts)}
    _check(f"slurm-{nodes}node-placement.json", json.dumps(placement, indent=2) + "\n")


def test_layout_inference_first_trainer_rest_orchestrator_beside_trainer() -> None:
    dep = load_run_config(PROFILES[4]).placement
    nodes = place(dep, ["a", "b", "c", "d"])
    assert nodes["inference"] == ["a", "b"]
    assert nodes["trainer"] == ["c", "d"]
    assert nodes["orchestrator"] == nodes["warmup"] == ["c"]  # the warm-up is one process


def test_a_trainer_on_two_nodes_runs_one_torchrun_agent_per_node_meeting_on_the_first() -> None:
    cfg = load_run_config(PROFILES[4])
    trainer = render_placement(cfg.placement, cfg.trainer.parallel, ["a", "b", "c", "d"])["trainer"]
    assert trainer["srun"][2:6] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=c,d"]
    assert trainer["launcher"] == [
        *("-m", "engines.trainer.torchrun", "--nnodes", "2", "--nproc-per-node", "4"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "c:29400", "--rdzv-id", RDZV_ID_PLACEHOLDER),
    ]
    one = load_run_config(PROFILES[1])
    assert render_placement(one.placement, one.trainer.parallel)["trainer"]["launcher"] == []


def test_a_trainer_on_several_nodes_needs_a_shared_filesystem_for_its_checkpoints() -> None:
    overrides = [("deployment.nodes", "3"), ("deployment.trainer_nodes", "2"), ("trainer.parallel.world_size", "2")]
    with pytest.raises(ConfigError, match=r"trainer_nodes=2 with output_dir='s3://b/run'.*shared path"):
        load_run_config([ROOT / "profiles/tiny-cpu.toml"], [*overrides, ("output_dir", "'s3://b/run'")])
    load_run_config([ROOT / "profiles/tiny-cpu.toml"], [*overrides, ("output_dir", "'/shared/runs/a'")])


def test_trainer_ranks_must_fill_the_trainer_nodes() -> None:
    with pytest.raises(ConfigError, match=r"world_size=6 must be a multiple of deployment.trainer_nodes=4"):
        load_run_config(
            [ROOT / "profiles/tiny-cpu.toml"],
            [("deployment.nodes", "5"), ("deployment.trainer_nodes", "4"), ("trainer.parallel.world_size", "6")],
        )


def test_allocation_with_other_node_count_is_refused() -> None:
    dep = load_run_config(PROFILES[2]).placement
    with pytest.raises(PlacementError, match=r"deployment.nodes=2"):
        place(dep, ["a", "b", "c"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [("deployment.nodes", "3")],
            r"deployment.inference_nodes=1 \+ deployment.trainer_nodes=1 must add up to deployment.nodes=3",
        ),
        ([("deployment.trainer_nodes", "2")], r"deployment.nodes=1: every component shares the node"),
        ([("deployment.slurm.time_limit", "'an hour'")], r"time_limit: .*'an hour' is not a Slurm time"),
        ([("deployment.slurm.mem", "'lots'")], r"deployment.slurm.mem: .*'lots' is not sbatch --mem syntax"),
        ([("deployment.slurm.extra_sbatch", "['exclusive']")], r"extra_sbatch: .*'exclusive' must be one long"),
        ([("deployment.gpus", "1")], r"deployment.gpus"),
    ],
)
def test_bad_deployment_is_refused_naming_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config([ROOT / "profiles/tiny-cpu.toml"], overrides)


def test_dry_run_writes_the_batch_script_and_placement(tmp_path) -> None:
    from rollflow.cli import main

    out = tmp_path / "run"
    profiles = [t for p in PROFILES[2] for t in ("@", str(p))]
    assert main(["rl", *profiles, "--output-dir", str(out), "--dry-run"]) == 0
    script = (out / "config" / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=gpu" in script
    assert f"rollflow.cli rl @ {PROFILES[2][0]} @ {PROFILES[2][1]} --output-dir {out}" in script
    placement = json.loads((out / "config" / "slurm-placement.json").read_text())
    assert placement["inference"]["nodes"] == ["$node0"] and placement["trainer"]["nodes"] == ["$node1"]


def test_numbers_for_mem_and_time_limit_are_read_as_text_from_the_command_line_and_toml(tmp_path) -> None:
    from rollflow.cli import main

    out = tmp_path / "run"
    tiny = str(ROOT / "profiles/tiny-cpu.toml")
    argv = ["rl", "@", tiny, "--output-dir", str(out), "--dry-run", "--deployment.slurm.mem", "0"]
    assert main([*argv, "--deployment.slurm.time-limit", "90"]) == 0
    script = (out / "config" / "slurm.sbatch").read_text()
    assert "#SBATCH --mem=0\n" in script and "#SBATCH --time=90\n" in script
    profile = tmp_path / "slurm.toml"
    profile.write_text("[deployment.slurm]\nmem = 512000\ntime_limit = 120\n")
    slurm = load_run_config([tiny, profile]).placement.slurm
    assert (slurm.mem, slurm.time_limit) == ("512000", "120")
    with pytest.raises(ConfigError, match=r"deployment.slurm.time_limit: .*'1.5' is not a Slurm time"):
        load_run_config([tiny], [("deployment.slurm.time_limit", "1.5")])


def test_a_requeued_job_resumes_the_run_it_started_and_never_overwrites_it(tmp_path) -> None:
    """rollflow/cli.py `requeued_flags`: Slurm runs a requeued job's script again (node failure, preemption)."""
    from rollflow.cli import requeued_flags

    cfg = load_run_config([ROOT / "profiles/tiny-cpu.toml"], [("output_dir", str(tmp_path))])
    requeued = {"SLURM_RESTART_COUNT": "1"}
    assert requeued_flags(cfg, {"overwrite"}, requeued) == {"overwrite"}  # no run yet: start it as asked
    (tmp_path / "rollouts").mkdir()
    assert requeued_flags(cfg, {"overwrite"}, requeued) == {"resume"}
    assert requeued_flags(cfg, set(), requeued) == {"resume"}
    assert requeued_flags(cfg, {"overwrite"}, {"SLURM_RESTART_COUNT": "0"}) == {"overwrite"}  # the first run
    assert requeued_flags(cfg, {"overwrite"}, {"SLURM_RESTART_COUNT": "x"}) == {"overwrite"}
    assert requeued_flags(cfg, set(), {}) == set()
