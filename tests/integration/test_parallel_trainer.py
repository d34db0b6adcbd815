"""The trainer on 2 gloo ranks under torchrun (FSDP2 through torchtitan's mesh) against 1 plain process:
same weights, seed and batches -> same losses and updated weights; and its DCP checkpoints resume on the
other number of ranks (2 -> 1 and 1 -> 2) exactly where the uninterrupted run goes.

Tolerance (fp32): 1e-5 relative on losses and on each tensor's norm of difference; measured on the worst
tensor 1.2e-6 to 8.7e-6 (2 FSDP2 ranks 8.7e-6, HSDP 2 x 2 4.8e-6): the runs differ only in the order the
gradient sums are added. Tensor parallelism also splits the forward's sums (o_proj, down_proj add per-rank
partial products): losses and gradient norms stay within 1e-5, weights within TP_TOL = 1e-4 (measured 3.2e-5:
AdamW divides by sqrt(v), so an element whose gradient nearly cancels turns the last-bit difference into a
visible one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("parallel_worker.py"))
TOL = 1e-5
TP_TOL = 1e-4
pytestmark = pytest.mark.slow


def _setup(
    out: Path,
    world: int,
    resume_step: int | None = None,
    source: Path | None = None,
    tp: int = 1,
    qk_norm: bool = False,
    **extra: object,
) -> Path:
    """A run directory with version 0 published (seed 0) and the trainer's config for `world` ranks
    (`tp` of them splitting each layer: tensor parallelism); `extra`: more trainer keys (packing, parallel.cp)."""
    from config.run import RunConfig

    root = source or out
    cfg = RunConfig.model_validate(
        {
            "output_dir": str(root),
            "model": {
                **{"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
                "qk_norm": qk_norm,  # Qwen3's per-head norms: their gradients need the tp group's sum
            },
            # 7 rows split 4 + 3 over 2 ranks: 2 vs 1 micro-batches of 3, so the even-up path runs too
            "trainer": {
                "micro_batch_size": 3,
                "measure_mismatch": False,
                **extra,
                "parallel": {"world_size": world, "tp": tp, **extra.get("parallel", {})},  # type: ignore[dict-item]
            },
        }
    )
    name = f"trainer-{world}-{tp}-{resume_step}-{zlib.crc32(json.dumps(extra, sort_keys=True).encode()):08x}.json"
    return write_trainer_config(cfg, out / name, resume_step, publish=source is None)


def write_trainer_config(cfg, path: Path, resume_step: int | None, publish: bool) -> Path:
    """The trainer's config of `cfg` at `path`; with `publish`, first version 0 of `cfg.model` (seed 0)."""
    from config.process import component_configs
    from engines.models import modeldir
    from storage import weights
    from storage.fs import Storage

    if publish:
        torch.manual_seed(0)
        loaded = modeldir.load(cfg.model, pretrained=False)
        fs, r = Storage(cfg.storage).open(cfg.output_dir)
        weights.publish(fs, r, 0, loaded.model.publishable_state_dict(), loaded.publication_files())
    trainer = component_configs(cfg, "parity", "http://127.0.0.1:9", resume_step=resume_step)["trainer"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trainer.model_dump_json())
    return path


def _train(config: Path, world: int, steps: int, checkpoint_at: int, result: Path, varied: bool = False) -> dict:
    """`varied`: samples of different lengths (so packing puts several in a row)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, *launcher, WORKER, str(config), str(steps), str(checkpoint_at), str(result)]
    argv += ["varied"] if varied else []
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(result, weights_only=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp(min=1e-12))


def _assert_close(a: dict, b: dict, last_losses: int, weight_tol: float = TOL) -> float:
    for x, y in zip(a["losses"][-last_losses:], b["losses"][-last_losses:], strict=True):
        assert abs(x - y) <= TOL * max(abs(x), 1e-3), (a["losses"], b["losses"])
    assert a["weights"].keys() == b["weights"].keys()
    worst = max(_rel(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert worst < weight_tol, worst
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 steps on 1 process, on 2 FSDP2 ranks and on 2 tensor-parallel ranks, each checkpointing after step 2."""
    base = tmp_path_factory.mktemp("parallel")
    one, two, tp = base / "one", base / "two", base / "tp"
    r1 = _train(_setup(one, 1), 1, 3, 2, base / "r1.pt")
    r2 = _train(_setup(two, 2), 2, 3, 2, base / "r2.pt")
    rtp = _train(_setup(tp, 2, tp=2), 2, 3, 2, base / "rtp.pt")
    return base, r1, r2, rtp


def test_two_fsdp2_ranks_match_one_process(runs):
    _, r1, r2, _ = runs
    assert (r1["world"], r2["world"]) == (1, 2)
    worst = _assert_close(r1, r2, 3)
    print(f"parity 2 ranks vs 1: worst weight rel diff {worst:.2e}, losses {r1['losses']} vs {r2['losses']}")
    assert r1["weights"]["model.layers.0.mlp.up_proj.weight"].shape == (128, 64)  # full, gathered on rank 0


@pytest.mark.long  # 4 gloo ranks (~1 min): `make test-long`
def test_hsdp_two_replicas_of_two_shards_match_one_process(runs, tmp_path):
    """HSDP on 4 ranks: dp_replicate = 2 copies of the model, each FSDP2-sharded over dp_shard = 2 ranks (the
    2-D mesh ("dp_replicate", "fsdp")), gradients reduce-scattered in a copy and summed across the copies."""
    _, r1, _, _ = runs
    hsdp = _train(_setup(tmp_path, 4, parallel={"dp_replicate": 2}), 4, 3, 0, tmp_path / "hsdp.pt")
    assert hsdp["world"] == 4
    worst = _assert_close(r1, hsdp, 3)
    assert all(abs(a - b) <= TOL * a for a, b in zip(r1["grad_norms"], hsdp["grad_norms"], strict=True))
    print(f"parity HSDP 2 x 2 vs 1: worst weight rel diff {worst:.2e}, losses {hsdp['losses']}")


def test_a_two_rank_checkpoint_resumes_on_one_process_and_back(runs):
    base, r1, _, _ = runs
    manifest = json.loads((base / "two/checkpoints/step=000002/trainer/_manifest.json").read_text())
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= manifest["files"].keys()
    # 2 -> 1: the 2-rank run's checkpoint, resumed by one process, does step 3 as the straight runs did
    r21 = _train(_setup(base / "two", 1, 2, source=base / "two"), 1, 3, 0, base / "r21.pt")
    _assert_close(r1, r21, 1)
    # 1 -> 2
    r12 = _train(_setup(base / "one", 2, 2, source=base / "one"), 2, 3, 0, base / "r12.pt")
    _assert_close(r1, r12, 1)


def test_two_tensor_parallel_ranks_match_one_process_and_resume_across_rank_counts(runs):
    """tp = 2: each rank holds half of every layer's heads and MLP width; the published weights are gathered
    whole, and the DCP checkpoints resume across the layouts (DTensor optimizer shards -> one plain process,
    and a plain process's checkpoint -> 2 tensor-parallel ranks)."""
    base, r1, _, rtp = runs
    worst = _assert_close(r1, rtp, 3, TP_TOL)
    print(f"parity tp=2 vs 1: worst weight rel diff {worst:.2e}, losses {r1['losses']} vs {rtp['losses']}")
    assert all(abs(a - b) <= TOL * a for a, b in zip(r1["grad_norms"], rtp["grad_norms"], strict=True))
    assert rtp["weights"]["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert rtp["weights"]["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    manifest = json.loads((base / "tp/checkpoints/step=000002/trainer/_manifest.json").read_text())
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= manifest["files"].keys()
    r_tp1 = _train(_setup(base / "tp", 1, 2, source=base / "tp"), 1, 3, 0, base / "rtp1.pt")
    _assert_close(r1, r_tp1, 1, TP_TOL)
    r_1tp = _train(_setup(base / "one", 2, 2, source=base / "one", tp=2), 2, 3, 0, base / "r1tp.pt")
    _assert_close(r1, r_1tp, 1, TP_TOL)


def test_two_torchrun_agents_meeting_over_c10d_match_one_process(runs):
    """The launcher a trainer step on 2 Slurm nodes runs on each node (launch/torchrun.py), here as two agents
    on this host, one rank each: they meet at the first "node"'s c10d store, form one 2-rank job, and train
    as the one process does."""
    from launch.torchrun import torchrun_args

    base, r1, _, _ = runs
    config, result = _setup(base / "nodes", 2), base / "rnodes.pt"
    launcher = torchrun_args(2, ["127.0.0.1", "127.0.0.1"], free_port())
    assert launcher[launcher.index("--nproc-per-node") + 1] == "1"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, *launcher, WORKER, str(config), "3", "0", str(result)]
    agents = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=300)[0].decode(errors="replace") for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    r = torch.load(result, weights_only=True)
    assert r["world"] == 2
    _assert_close(r1, r, 3)


def test_the_warm_up_on_two_ranks_publishes_what_one_process_does(tmp_path):
    """The warm-up (SFT) with trainer.parallel.world_size = 2: FSDP2 over 2 gloo ranks under torchrun, each
    rank half of every batch; version 0 as rank 0 publishes it equals the one process's."""
    from config.process import component_configs
    from config.run import RunConfig
    from launch.torchrun import torchrun_args
    from storage import weights
    from storage.fs import get_fs

    published = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        cfg = RunConfig.model_validate(
            {
                "output_dir": str(out),
                "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
                "sft": {"steps": 4, "batch_size": 7},  # 4 + 3 rows over 2 ranks
                "trainer": {"parallel": {"world_size": world}},
            }
        )
        sft = component_configs(cfg, "warm-up", "http://127.0.0.1:9")["sft"]
        assert sft.parallel.world_size == world  # type: ignore[attr-defined]
        path = tmp_path / f"sft-{world}.json"
        path.write_text(sft.model_dump_json())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, *torchrun_args(world), "-m", "engines.trainer", "--config", str(path)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        fs, root = get_fs(str(out))
        published[world] = weights.load(fs, weights.version_dir(root, 0))
    one, two = published[1], published[2]
    assert one.keys() == two.keys()
    worst = max(_rel(one[k], two[k]) for k in one)
    print(f"warm-up 2 ranks vs 1: worst weight rel diff {worst:.2e}")
    assert worst < TOL, worst


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_with_fsdp2_on_a_qwen3_model_matches_one_process(runs):
    """2-D: tp = 2 inside each of 2 FSDP2 shards (4 ranks), on a model with Qwen3's per-head q/k norms, and tp
    alone on the same model, against one process; the 2-D run's checkpoint resumes on one process."""
    base = runs[0]
    one = _train(_setup(base / "qk1", 1, qk_norm=True), 1, 3, 2, base / "qk1.pt")
    tp = _train(_setup(base / "qktp", 2, tp=2, qk_norm=True), 2, 3, 0, base / "qktp.pt")
    worst_tp = _assert_close(one, tp, 3, TP_TOL)
    two_d = _train(_setup(base / "qk2d", 4, tp=2, qk_norm=True), 4, 3, 2, base / "qk2d.pt")
    worst = _assert_close(one, two_d, 3, TP_TOL)
    assert all(abs(a - b) <= TOL * a for a, b in zip(one["grad_norms"], two_d["grad_norms"], strict=True))
    print(f"parity qk_norm, tp=2: {worst_tp:.2e}; dp_shard=2 x tp=2: {worst:.2e}, losses {two_d['losses']}")
    resumed = _train(_setup(base / "qk2d", 1, 2, source=base / "qk2d", qk_norm=True), 1, 3, 0, base / "qk2d1.pt")
    _assert_close(one, resumed, 1, TP_TOL)


def test_a_corrupted_dcp_shard_is_refused(runs, tmp_path):
    """On a copy of the 1-process run's checkpoint: the resume tests read the original."""
    import shutil

    from engines.trainer import checkpoint
    from storage.fs import CorruptError, get_fs

    base, _, _, _ = runs
    shutil.copytree(base / "one/checkpoints", tmp_path / "one/checkpoints")
    shard = tmp_path / "one/checkpoints/step=000002/trainer/optimizer/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    fs, root = get_fs(str(tmp_path / "one"))
    state = checkpoint.TrainerState(torch.nn.Linear(1, 1), {"optimizer": None}, None, 0)  # type: ignore[dict-item]
    with pytest.raises(CorruptError, match="checksum mismatch"):
        checkpoint.restore(fs, root, 2, state)


RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out, rank = Path(sys.argv[1]), os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
(out / f"ready-{rank}").write_text("")
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
(out / f"got-{rank}").write_text(str(len(got)))
"""


def test_the_torchrun_agent_relays_sigusr1_to_every_rank(tmp_path):
    """The flow's "checkpoint now" (SIGUSR1 to the trainer's process group) reaches ranks that torchrun
    started in sessions of their own, and the agent itself survives it."""
    import signal
    import time

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "engines.trainer.torchrun", "--standalone", "--nproc-per-node", "2"]
    agent = subprocess.Popen([*argv, str(script), str(tmp_path)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert agent.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        os.killpg(agent.pid, signal.SIGUSR1)
        assert agent.wait(timeout=60) == 0  # the ranks exited 0 after their signal; the agent lived on
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert [(tmp_path / f"got-{r}").read_text() for r in (0, 1)] == ["1", "1"]
