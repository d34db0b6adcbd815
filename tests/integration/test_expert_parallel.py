"""Expert parallelism on 2 gloo ranks under torchrun (ep = 2: each rank holds half of every layer's experts,
torchtitan's all-to-all token dispatcher moves the routed tokens) against 1 plain process: same weights, seed
and batches -> same losses, gradient norms and updated weights (every expert, gathered to rank 0 under its
Hugging Face name); the DCP checkpoints resume 2 -> 1 and 1 -> 2 ranks where the straight run goes; and the
short tiny-moe-cpu run goes through the real `rollflow rl` flow with its trainer as 2 expert-parallel ranks.

Tolerance as for FSDP2 (test_parallel_trainer.py): 1e-5 relative on losses and on each tensor's norm of
difference; the measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import start_cli
from safetensors.torch import load_file
from test_moe_run import ARGS, _assert_replay_in_effect, _assert_routing_payloads
from test_parallel_trainer import TOL, _assert_close, _train, write_trainer_config
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.slow

MODEL = {
    "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
    "qk_norm": True, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    # Not renormalised: with renormalisation, ids [0, 1] replayed from step 1 give rows 2, 3 of the router a
    # gradient of rounding noise only, which AdamW (dividing by its sqrt(v)) turns into lr-sized steps.
    "norm_topk_prob": False,
}  # fmt: skip


def _setup(out: Path, world: int, ep: int, resume_step: int | None = None, source: Path | None = None) -> Path:
    """A run directory with the tiny MoE's version 0 published (seed 0) and the trainer's config."""
    from config.run import RunConfig

    root = source or out
    parallel = {"world_size": world, "ep": ep}
    cfg = RunConfig.model_validate(
        {
            "output_dir": str(root),
            "model": MODEL,
            # 7 rows split 4 + 3 over 2 ranks: 2 vs 1 micro-batches of 3 (a zero-weight stand-in dispatches too)
            # router replay sends every token of layer 0 (always) and layer 1 (from step 2 on) to experts 0, 1
            # (parallel_worker.py): experts 2, 3 there get no gradient, as on one process
            "trainer": {
                "micro_batch_size": 3,
                "measure_mismatch": False,
                "parallel": parallel,
                "enable_router_replay": True,
            },
        }
    )
    return write_trainer_config(cfg, out / f"trainer-{world}-{ep}-{resume_step}.json", resume_step, source is None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """3 steps on 1 process and on 2 expert-parallel ranks, each checkpointing after step 2."""
    base = tmp_path_factory.mktemp("ep")
    r1 = _train(_setup(base / "one", 1, 1), 1, 3, 2, base / "r1.pt")
    r2 = _train(_setup(base / "two", 2, 2), 2, 3, 2, base / "r2.pt")
    return base, r1, r2


def test_two_expert_parallel_ranks_match_one_process(runs):
    from storage import weights
    from storage.fs import get_fs

    base, r1, r2 = runs
    worst = _assert_close(r1, r2, 3)
    norms = max(abs(a - b) / a for a, b in zip(r1["grad_norms"], r2["grad_norms"], strict=True))
    losses = max(abs(a - b) / abs(a) for a, b in zip(r1["losses"], r2["losses"], strict=True))
    print(f"ep=2 vs 1: worst weight rel diff {worst:.2e}, loss {losses:.2e}, grad norm {norms:.2e}")
    assert norms <= TOL
    experts = [k for k in r2["weights"] if ".mlp.experts." in k]
    assert len(experts) == 2 * 4 * 3  # every expert of both layers, gathered to rank 0
    assert r2["weights"]["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 64)
    fs, root = get_fs(str(base / "two"))
    initial = weights.load(fs, weights.version_dir(root, 0))
    still = {k for k in experts if torch.equal(r2["weights"][k], initial[k])}
    # only the experts no token ever reached stayed put: those of both ranks trained (the comparison is not vacuous)
    assert still == {k for k in experts if k.split(".mlp.experts.")[1][0] in "23" and ".layers.0." in k}


def test_fsdp2_without_expert_parallelism_matches_one_process(runs):
    """ep = 1 on 2 FSDP2 ranks: every expert runs on each rank (on no tokens too, or the ranks' reduce-scatters
    would differ in size and gloo aborts), and the experts no rank routed to get no gradient, as on one process."""
    base, r1, _ = runs
    dp = _train(_setup(base / "dp", 2, 1), 2, 3, 0, base / "rdp.pt")
    worst = _assert_close(r1, dp, 3)
    print(f"MoE, FSDP2 ep=1 vs 1: worst weight rel diff {worst:.2e}")
    assert all(abs(a - b) <= TOL * a for a, b in zip(r1["grad_norms"], dp["grad_norms"], strict=True))


def test_an_expert_parallel_checkpoint_resumes_on_one_process_and_back(runs):
    base, r1, _ = runs
    manifest = json.loads((base / "two/checkpoints/step=000002/trainer/_manifest.json").read_text())
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= manifest["files"].keys()
    reader = FileSystemReader(str(base / "two/checkpoints/step=000002/trainer/optimizer"))
    saved = {
        k.split(".state.", 1)[1].rsplit(".", 1)[0] for k in reader.read_metadata().state_dict_metadata if ".state." in k
    }
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved  # rank 1's experts are in the checkpoint
    assert "model.layers.0.mlp.experts.3.up_proj.weight" not in saved  # never a gradient: no AdamW state
    r21 = _train(_setup(base / "two", 1, 1, 2, source=base / "two"), 1, 3, 0, base / "r21.pt")
    _assert_close(r1, r21, 1)
    r12 = _train(_setup(base / "one", 2, 2, 2, source=base / "one"), 2, 3, 0, base / "r12.pt")
    _assert_close(r1, r12, 1)


# `make test-long` (~35 s): make test keeps its parts (the EP parity and checkpoint tests above, the flow's
# torchrun trainer in test_parallel_run.py, routing payloads and replay in test_moe_run.py)
@pytest.mark.long
def test_the_moe_flow_runs_with_an_expert_parallel_trainer(tmp_path, prefect_api):
    """tiny-moe-cpu (shortened) through the real CLI with `--trainer.parallel.world-size 2 --trainer.parallel.ep 2`:
    routing payloads committed, router replay in effect, every expert published."""
    out, log = tmp_path / "run", tmp_path / "cli.log"
    parallel = ("--trainer.parallel.world-size", "2", "--trainer.parallel.ep", "2")
    cli = start_cli(tmp_path, log, prefect_api, *ARGS, *parallel, "--output-dir", str(out))
    assert cli.wait(300) == 0, log.read_text()[-3000:]
    assert "engines.trainer.torchrun --standalone --nproc-per-node 2" in log.read_text()
    _assert_routing_payloads(out)
    _assert_replay_in_effect(out)
    published = load_file(out / "weights" / "step=000004" / "model.safetensors")
    assert sum(".mlp.experts." in k for k in published) == 3 * 4 * 3  # layers x experts x projections
