"""Resume bookkeeping on CPU in milliseconds: leases, config compatibility, resume point and rollback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from config.eval import EvalConfig
from config.inference import AUTO_VLLM_MIN_PARAMS
from config.loader import stored_with_sources
from config.process import component_configs
from config.resume import resume_changes
from config.run import RunConfig
from config.sft import SFTConfig
from config.teacher import TeacherConfig
from config.tracking import TrackingConfig
from config.trainer import TrainerConfig
from config.trainer_parallel import TrainerParallelConfig
from launch import vllm as vllm_launch
from rollflow.cli import main
from runtime.rundir import RunDirError, check_resumable, stored_config, write_run_config
from storage import checkpoints, rollouts, runstate, weights
from storage.fs import get_fs
from storage.metrics import MetricsLog, read_metrics
from storage.resume import repair, resume_point, rollback

TINY = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.toml"
# A run directory's configs as the code before the config renames wrote them: `rollflow rl @
# profiles/tiny-moe-cpu.toml --dry-run` with --inference.backend vllm, --deployment.num_infer_replicas 2,
# --inference.router.policy round_robin, --inference.deployment '{type = "single_node", backend_port = 8200}',
# --inference.vllm.startup_timeout_s 300, --trainer.parallel.backend gloo, --weight-broadcast.backend gloo,
# --deployment.slurm.mem 8G (OUTPUT_DIR stands for the run directory).
STORED = Path(__file__).parent / "golden" / "stored-run"


def test_a_live_lease_is_refused_and_an_expired_or_dead_one_is_taken(tmp_path):
    fs, root = get_fs(str(tmp_path))
    lease = runstate.acquire(fs, root, ttl_s=30, settle_s=0)
    with pytest.raises(runstate.LeaseHeld, match="already being run"):
        runstate.acquire(fs, root, ttl_s=30, settle_s=0)
    # Expired, but its process (this one) lives: hung, or the clock stepped. Taken only after watching it go
    # unrenewed for its TTL.
    lease.expires_at, lease.ttl_s = time.time() - 1, 0.5
    (tmp_path / "lease.json").write_text(json.dumps(lease.__dict__))
    t0 = time.monotonic()
    taken = runstate.acquire(fs, root, ttl_s=30, settle_s=0)
    assert 0.5 <= time.monotonic() - t0 < 3
    assert taken.owner != lease.owner and taken.generation == lease.generation + 1
    assert not runstate.renew(fs, root, lease, 30)  # the old holder cannot renew someone else's lease
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    taken.pid = dead.pid
    (tmp_path / "lease.json").write_text(json.dumps(taken.__dict__))
    runstate.acquire(fs, root, ttl_s=30, settle_s=0)  # held by a dead process on this host


def test_release_removes_only_our_own_lease(tmp_path):
    fs, root = get_fs(str(tmp_path))
    ours = runstate.acquire(fs, root, ttl_s=30, settle_s=0)
    other = runstate.Lease("someone-else", "host", os.getpid(), time.time() + 30)
    runstate.release(fs, root, other)
    assert runstate.read_lease(fs, root).owner == ours.owner
    runstate.release(fs, root, ours)
    assert runstate.read_lease(fs, root) is None


def test_resume_changes_split_incompatible_from_compatible():
    old = RunConfig().model_dump(mode="json")
    new = RunConfig(max_steps=7, model={"hidden_size": 64}, orchestrator={"group_size": 4}).model_dump(mode="json")
    new["trainer"]["optim"]["lr"] = 5e-4
    new["inference"]["port"] = 1234  # picked at launch: never a change
    bad, ok = resume_changes(old, new)
    assert set(bad) == {"model.hidden_size", "orchestrator.group_size"}
    assert ok == {"max_steps": (100, 7), "trainer.optim.lr": (1e-3, 5e-4)}


def _run_dir(tmp_path: Path, **changes) -> RunConfig:
    cfg = RunConfig(output_dir=str(tmp_path / "run"), **changes)
    fs, root = get_fs(cfg.output_dir)
    write_run_config(cfg, "rid")
    runstate.write_state(fs, root, runstate.RunState(run_id="rid", mlflow_run_id=None))
    weights.publish(fs, root, 0, {"w": torch.zeros(2)})
    return cfg


def test_resume_with_an_incompatible_change_is_refused_listing_every_difference(tmp_path, capsys):
    cfg = _run_dir(tmp_path)
    with pytest.raises(RunDirError) as err:
        check_resumable(RunConfig(output_dir=cfg.output_dir, seed=3, orchestrator={"group_size": 4}))
    assert "seed: 0 -> 3" in str(err.value) and "orchestrator.group_size: 8 -> 4" in str(err.value)
    assert check_resumable(RunConfig(output_dir=cfg.output_dir, max_steps=200)) == {"max_steps": (100, 200)}
    # the CLI refuses before starting anything, exit code 2
    assert main(["resume", cfg.output_dir, "--model.num_layers", "5"]) == 2
    assert "model.num_layers: 3 -> 5" in capsys.readouterr().err


def test_cli_refuses_a_run_that_is_live(tmp_path, capsys):
    cfg = _run_dir(tmp_path)
    fs, root = get_fs(cfg.output_dir)
    runstate.acquire(fs, root, ttl_s=60, settle_s=0)  # this (live) test process holds it
    assert main(["resume", cfg.output_dir]) == 2
    assert "is being run right now" in capsys.readouterr().err
    assert main(["rl", "@", str(TINY), "--output-dir", cfg.output_dir, "--overwrite"]) == 2
    assert (tmp_path / "run" / "weights").exists()
    assert main(["resume", str(tmp_path / "nothing-here")]) == 2
    assert "holds no rollflow run to resume" in capsys.readouterr().err


def _checkpoint(fs, root, step: int) -> None:
    checkpoints.save(fs, root, step, "trainer", {"model.safetensors": b"w" * 8, "trainer_state.pt": b"s" * 8})


def test_resume_point_skips_a_corrupt_checkpoint_and_says_which_file(tmp_path):
    fs, root = get_fs(str(tmp_path))
    for step in (2, 4):
        _checkpoint(fs, root, step)
    path = tmp_path / "checkpoints" / "step=000004" / "trainer" / "trainer_state.pt"
    path.write_bytes(b"s" * 5)  # truncated
    said: list[str] = []
    assert resume_point(fs, root, said.append) == 2
    assert len(said) == 1 and str(path) in said[0] and "falling back" in said[0]
    assert resume_point(get_fs(str(tmp_path / "empty"))[0], str(tmp_path / "empty"), said.append) is None


def test_rollback_keeps_committed_rollouts_and_drops_what_the_checkpoint_does_not_cover(tmp_path):
    fs, root = get_fs(str(tmp_path))
    for v in range(5):
        weights.publish(fs, root, v, {"w": torch.full((2,), float(v))})
    table = rollouts.to_table([])
    for step in (1, 2, 3, 4, 5):
        rollouts.write_step(fs, root, step, table, {})
    (tmp_path / "rollouts" / "step=000006").mkdir()  # a write cut short: files, no manifest
    (tmp_path / "rollouts" / "step=000006" / "part-00000.arrow").write_bytes(b"partial")
    _checkpoint(fs, root, 2)
    metrics = MetricsLog(fs, root)
    for s in range(1, 5):
        metrics.record({"step": s})
    removed = rollback(fs, root, 2)
    assert weights.latest_version(fs, root) == 2
    assert rollouts.committed_rollout_steps(fs, root) == [1, 2, 3, 4, 5]
    assert not (tmp_path / "rollouts" / "step=000006").exists()
    assert [r["step"] for r in read_metrics(fs, root)] == [1, 2]
    assert len(removed) == 4  # weights 3 and 4, the partial rollout step, the metrics rows
    assert rollback(fs, root, 2) == []  # idempotent


def test_repair_resamples_a_corrupt_rollout_step_and_rewrites_corrupt_weights_from_the_checkpoint(tmp_path):
    from safetensors.torch import save

    fs, root = get_fs(str(tmp_path))
    good = {"w": torch.arange(3.0)}
    weights.publish(fs, root, 2, good)
    files = {"model.safetensors": save(good), "trainer_state.pt": b"s", "run_state.json": b"{}"}
    hf = {"config.json": b"{}", "tokenizer.json": b"t"}  # what the checkpoint keeps beside the weights
    checkpoints.save(fs, root, 2, "trainer", {**files, **hf, "optimizer/.metadata": b"m"})
    for step in (1, 2, 3, 4):
        rollouts.write_step(fs, root, step, rollouts.to_table([]), {})
    shard = tmp_path / "rollouts" / "step=000003" / "part-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-7])
    wfile = tmp_path / "weights" / "step=000002" / "model.safetensors"
    wfile.write_bytes(b"x" * wfile.stat().st_size)  # same size, wrong bytes
    said: list[str] = []
    repair(fs, root, 2, said.append)
    assert rollouts.committed_rollout_steps(fs, root) == [1, 2, 4]
    assert any(str(shard) in s and "sampled again" in s for s in said)
    assert any(str(wfile) in s and "rewriting it from checkpoint step=2" in s for s in said)
    assert torch.equal(weights.load(fs, weights.version_dir(root, 2))["w"], good["w"])
    rewritten = tmp_path / "weights" / "step=000002"
    assert {p.name for p in rewritten.iterdir()} == {"model.safetensors", "_manifest.json", *hf}
    said.clear()
    repair(fs, root, 2, said.append)
    assert said == []


def _stored(name: str, out: Path) -> dict:
    return json.loads((STORED / name).read_text().replace("OUTPUT_DIR", str(out)))


def _admission(sub) -> dict:
    limits = ("max_queued_requests", "max_queued_tokens", "retry_after_s")
    return {k: getattr(sub.inference, k) for k in limits}


def test_a_run_directory_written_before_the_config_renames_loads_and_resumes_unchanged(tmp_path):
    out = tmp_path / "run"
    fs, root = get_fs(str(out))
    (out / "config").mkdir(parents=True)
    (out / "config" / "run.json").write_text(json.dumps(_stored("run.json", out)))
    runstate.write_state(fs, root, runstate.RunState(run_id="rid", mlflow_run_id=None))
    cfg, _ = stored_with_sources(stored_config(str(out)), "run.json", [("output_dir", str(out))])  # as `resume`
    v = cfg.inference.vllm
    assert (v.num_infer_replicas, v.router.policy, v.deployment.server_port, v.startup_timeout_s) == (
        2, "round_robin", 8200, 300.0
    )  # fmt: skip
    assert cfg.trainer.parallel.c10d_backend == cfg.weight_broadcast.c10d_backend == "gloo"
    assert cfg.placement.slurm.mem == "8G" and cfg.inference.enable_return_routed_experts
    assert check_resumable(cfg) == {}  # nothing differs from what the run stored
    # every process config is written as before (the orchestrator's gained the session header it sends, the
    # router's configured one, and reads `normalize_advantages` as the grpo estimator it always was; env entries
    # got `advantage`), and the vLLM servers are started with the same commands
    slices = component_configs(cfg, stored_config(str(out))["run_id"], "http://127.0.0.1:0")
    no_teacher = {"teacher": TeacherConfig().model_dump(mode="json"), "teacher_url": None}  # [teacher] is newer
    no_eval = {"eval": EvalConfig().model_dump(mode="json")}  # [eval] came later: its defaults, interval 0
    added = {
        # routed_experts: the orchestrator asks for routes now that the server sends them only when asked
        # tenant: None, a run of its own (not a shared deployment's tenant, docs/multitenant.md)
        "orchestrator": {
            "session_header": "X-Session-ID",
            "routed_experts": True,
            "tenant": None,
            **no_teacher,
            **no_eval,
        },
        "trainer": no_eval,
        # role..pretrained: set by rollflow eval only; shared: by a shared deployment only
        "inference": {"role": "policy", "serve_version": None, "pretrained": False, "shared": None},
        "sft": {"sft_run": None},  # None: the RL warm-up
    }
    for name, sub in slices.items():
        stored = _stored(f"{name}.json", out)
        for env in stored.get("envs", []):
            env["advantage"] = None  # the orchestrator's estimator (an `[[envs]]` entry's own: none)
        if name == "orchestrator":
            section = stored["orchestrator"]
            assert section.pop("normalize_advantages") is True
            section["advantage"] = {
                "type": "grpo",
                "normalize_std": True,
                "group_baseline": None,
                "eps": None,
                "args": {},
            }
            section["overlong"] = {"buffer": 0, "penalty": 1.0}
            section.update(top_p=1.0, top_k=0)  # no truncation, as before they were settings
            section.update(max_inflight_groups=0, stale_turns="mask")  # no carry-over: each step's own groups
        if "trainer" in stored:  # the loss gained a `type` (masked_is: what it always was) and the keys beside it
            stored["trainer"] = TrainerConfig.model_validate(stored["trainer"]).model_dump(mode="json")
            assert stored["trainer"]["loss"]["type"] == "masked_is" and stored["trainer"]["mini_batches"] == 1
        if "sft" in stored:  # the warm-up's section gained the data source (the environments: what it always read)
            stored["sft"] = SFTConfig.model_validate(stored["sft"]).model_dump(mode="json")
            assert stored["sft"]["data"] == {"type": "envs"} and stored["sft"]["packing"] is False
        if "model" in stored:  # [model.vlm] came later: none (a text model)
            stored["model"] = {**stored["model"], "vlm": None}
        if name == "sft":  # the bound on the warm-up's collectives came later: its default
            stored["parallel"] = {**stored["parallel"], "timeout_s": TrainerParallelConfig().timeout_s}
        if "tracking" in stored:  # the MLflow image sheet's settings came later: their defaults
            stored["tracking"] = TrackingConfig.model_validate(stored["tracking"]).model_dump(mode="json")
        if "inference" in stored:  # admission limits came later: their defaults (an unset token budget rises at load)
            stored["inference"] = {**stored["inference"], **_admission(sub)}
            stored["inference"]["auto_vllm_min_params"] = AUTO_VLLM_MIN_PARAMS  # backend "auto" came later: its default
            stored["inference"]["onednn_linear"] = False  # so did the oneDNN linear option: off
        assert sub.model_dump(mode="json") == {**stored, **added.get(name, {})}, name
    script = vllm_launch.plan_script(vllm_launch.render(cfg.inference, max_model_len=64, under_slurm=True))
    # added since that run was written: vLLM answers the proxy only
    script = script.replace(f" --middleware {vllm_launch.AUTH_MIDDLEWARE}", "")
    assert script.splitlines()[1:] == (STORED / "vllm-commands.sh").read_text().splitlines()[1:]
