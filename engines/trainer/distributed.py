"""The trainer's place among torchrun's ranks: process group, device mesh, each rank's rows, collectives on numbers.

Data flow: `trainer.parallel` + torchrun's env (RANK, WORLD_SIZE) -> `init` (gloo on CPU, NCCL on GPU;
torchtitan's `ParallelDims` builds the mesh) -> `Dist`, which every other trainer module takes ->
`local_share`/`local_rows` (the rows of the step's batch this rank trains on) -> `even_micro_batches` (as
many micro-batches on every rank) -> `all_reduce` (the step's statistics) -> `barrier`/`shutdown`.
engines/trainer/parallel.py shards the model over the mesh; engines/trainer/context_parallel.py splits each
row's tokens over its `cp` axis.

With `world_size = 1` nothing here touches torch.distributed: the trainer is the plain process it was.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from config.trainer_parallel import TrainerParallelConfig
from engines.trainer import compat
from engines.trainer.batch import Batch


@dataclass
class Dist:
    """This rank's place: `dp_rank` of `dp_size` picks its rows of each step's batch."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = torch.device("cpu")
    dims: Any = None  # torchtitan ParallelDims (mesh built) when world > 1
    cp: int = 1  # context parallel ranks splitting each row's tokens (engines/trainer/context_parallel.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own: without this a SIGKILLed agent (the flow's
    supervised child) would leave its ranks running, still writing to the run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux/glibc
    if os.getppid() == 1:  # the agent died before the call above
        raise SystemExit("torchrun's agent is gone")


def backend_for(p: TrainerParallelConfig) -> str:
    if p.c10d_backend != "auto":
        return p.c10d_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(p: TrainerParallelConfig) -> Dist:
    """Join torchrun's process group and build torchtitan's mesh; a plain `Dist` for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != p.world_size:
        raise SystemExit(
            f"trainer.parallel.world_size={p.world_size} but this process runs with WORLD_SIZE={world}; "
            "the rl flow starts the trainer with torchrun --nproc-per-node world_size"
        )
    if world == 1:
        return Dist()
    _die_with_launcher()
    compat.require_supported()
    import torch.distributed as dist

    backend = backend_for(p)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        compat.torchtitan_on_cpu()
    # every collective of the group is bounded: a peer that never joins fails the rank, and the flow restarts it
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=p.timeout_s))
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=p.dp_replicate, dp_shard=p.shard_size, cp=p.cp, tp=p.tp, pp=1, ep=p.ep, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    # Ranks are laid out (batch, cp, tp) row-major: cp and tp neighbours share a data-parallel rank.
    return Dist(rank, world, rank // (p.cp * p.tp), p.dp_size, device, dims, p.cp)


def local_share(batch: Batch, d: Dist) -> tuple[Batch, float]:
    """This rank's contiguous slice of the step's rows, weight 1; with fewer rows than data-parallel ranks,
    the ranks left over get the first row as a stand-in, weight 0 (they must still run forward/backward)."""
    if not d.enabled:
        return batch, 1.0
    rows, weight = local_rows(batch.input_ids.shape[0], d)
    return batch.select(rows), weight


def local_rows(n: int, d: Dist) -> tuple[torch.Tensor, float]:
    """The indices of this rank's share of `n` rows and its loss weight (see `local_share`)."""
    rows = torch.tensor_split(torch.arange(n), d.dp_size)[d.dp_rank]
    return (rows, 1.0) if len(rows) else (torch.arange(1), 0.0)


def even_micro_batches(mbs: Sequence[Any], weight: float, d: Dist) -> Iterator[tuple[Any, float]]:
    """Each micro-batch with its loss weight, then zero-weight repeats until every rank has run as many as
    the busiest one: FSDP's all-gathers and reduce-scatters pair up across ranks call by call."""
    count = int(all_reduce([float(len(mbs))], d, "max")[0]) if d.enabled else len(mbs)
    for i in range(count):
        mb = to_device(mbs[min(i, len(mbs) - 1)], d.device)
        yield (mb, weight) if i < len(mbs) else (mb, 0.0)


def to_device(mb: Any, device: torch.device) -> Any:
    """A (packed) micro-batch with its tensors on the ranks' device (GPU ranks); unchanged on the CPU."""
    if device.type == "cpu":
        return mb
    moved = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    return dataclasses.replace(mb, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})


def all_reduce(values: list[float], d: Dist, op: str = "sum") -> list[float]:
    """Sum (or max) plain numbers over the ranks; tp neighbours hold the same rows and count once, cp
    neighbours hold different tokens of them and add up. Identity for one process."""
    if not d.enabled:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op != "max":
        t /= d.world // (d.dp_size * d.cp)
    return t.tolist()


def barrier(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.destroy_process_group()
