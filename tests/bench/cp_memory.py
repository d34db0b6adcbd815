"""Context parallelism's memory per rank: one trainer forward + backward on a long packed row, 1 process
against `cp` gloo ranks under torchrun (docs/parallelism.md, docs/benchmarks.md).

`python -m tests.bench.cp_memory [--tokens 8192] [--cp 2]`: each run builds rollflow's model (4 layers,
256 wide), shards it with FSDP2 (cp ranks) as the trainer does, warms up on a short row, resets the
kernel's peak-RSS mark (`/proc/self/clear_refs`), then runs the trainer's packed logprobs, a token-sum
loss and backward on one row of `--tokens` tokens (4 samples, block-diagonal mask), the cp runs through
engines/trainer/context_parallel.py. Prints one JSON line per configuration: the step's peak resident
memory above what the process held before it (MiB, worst rank) and the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TITLE = "Context parallelism's memory per rank (tests/bench/cp_memory.py)"
ROOT = Path(__file__).resolve().parents[2]
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _row(tokens: int, vocab: int):  # -> PackedBatch
    import torch

    from engines.trainer.batch import PackedBatch

    g = torch.Generator().manual_seed(0)
    span = tokens // 4
    ids = torch.randint(4, vocab, (1, tokens), generator=g)
    full = torch.ones(1, tokens)
    return PackedBatch(
        input_ids=ids, positions=(torch.arange(tokens) % span)[None], segments=(torch.arange(tokens) // span)[None],
        targets=torch.roll(ids, -1, 1), loss_mask=full, sampler_logprobs=-full, advantages=full, temperatures=full,
    )  # fmt: skip


def _step(model, row, d) -> None:  # type: ignore[no-untyped-def]
    from engines.trainer import context_parallel
    from engines.trainer.common import packed_logprobs

    mb = context_parallel.shard(row, d)
    with context_parallel.gathered_kv(d):
        logp = packed_logprobs(model, mb)  # type: ignore[arg-type]
    (-(logp * mb.loss_mask).sum() / row.loss_mask.sum()).backward()


def rank_main(tokens: int) -> None:
    """One rank (or the one process): warm up, then measure one long step."""
    import torch

    from config.model import ModelConfig
    from config.trainer_parallel import TrainerParallelConfig
    from engines.models.decoder import CausalLM
    from engines.trainer import distributed, parallel

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p = TrainerParallelConfig(world_size=world, cp=world)
    d = distributed.init(p)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SHAPE, max_seq_len=tokens), 512)  # type: ignore[arg-type]
    parallel.parallelize(model, d, p)
    _step(model, _row(64, 512), d)
    model.zero_grad(set_to_none=False)  # gradients stay allocated: the step below adds activations only
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    t0 = time.perf_counter()
    _step(model, _row(tokens, 512), d)
    seconds = time.perf_counter() - t0
    peak = _rss_kib("VmHWM") - before
    result = torch.tensor([peak / 1024, seconds], dtype=torch.float64)
    if d.enabled:
        import torch.distributed as dist

        dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if d.is_main:
        print(json.dumps({"world": world, "cp": world, "tokens": tokens, "step_peak_mib": round(float(result[0]), 1),
                          "step_s": round(float(result[1]), 2)}))  # fmt: skip
    distributed.shutdown(d)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.cp_memory", description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of a run
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args.tokens)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for world in (1, args.cp):
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
        argv_ = [sys.executable, *launcher, "-m", "tests.bench.cp_memory", "--rank", "--tokens", str(args.tokens)]
        out = subprocess.run(argv_, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        print([line for line in out.stdout.splitlines() if line.startswith("{")][-1], flush=True)


def run(ws: object) -> str:
    """The runner's entry (`python -m tests.bench --every --quick`): its own command on a 256-token row in quick
    mode (1 process and 2 gloo ranks under torchrun), the JSON lines as they are."""
    from tests.bench import harness

    tokens = "256" if harness.QUICK else "8192"
    return "```json\n" + harness.module_output("tests.bench.cp_memory", "--tokens", tokens).strip() + "\n```"


if __name__ == "__main__":
    main()
