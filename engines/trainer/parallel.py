"""The trainer under torchrun: process group, torchtitan's device mesh, FSDP2 sharding, each rank's data.

Data flow: `trainer.parallel` + torchrun's env (RANK, WORLD_SIZE) -> `init` (gloo on CPU, NCCL on GPU;
torchtitan's `ParallelDims` builds the mesh) -> `parallelize` (tensor parallelism first, over `tp`; MoE
experts spread over `ep` (engines/trainer/expert_parallel.py); then torch's FSDP2 `fully_shard` per decoder
layer and at the root, over the mesh's `fsdp` (dp_shard x cp, + `dp_replicate` for HSDP) axes; torchtitan's
`disable_fsdp_gradient_division`, so gradients are summed: every rank's loss is already divided by the
step's global token count) -> `local_share` (the rows of the step's batch this rank trains on; with cp,
engines/trainer/context_parallel.py splits each row's tokens) -> `clip_grad_norm` (first completes the
gradients that need it: q/k norms over tp, unrouted experts dropped) -> `full_state_dict` (all ranks
gather, rank 0 keeps the weights to publish).

With `world_size = 1` nothing here touches torch.distributed: the trainer is the plain process it was.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from config.trainer_parallel import TrainerParallelConfig, check_against_model, check_tp
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


def _torchtitan_on_cpu() -> None:
    """torchtitan 0.3.0 imports its GPU kernels module (triton) and picks its device at import time:
    stub the one and point the other at the CPU before anything of torchtitan is imported."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            sys.modules[name] = stub = types.ModuleType(name)
            stub.__getattr__ = _no_kernel  # type: ignore[method-assign]  # names imported by its EP dispatchers
    # torchtitan's mesh gives size-1 axes the "fake" backend, which only this torch module registers.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu


def _no_kernel(attr: str) -> Any:
    """A name of the stubbed triton kernels module: importable (the all-to-all dispatcher's module imports the
    symmetric-memory dispatcher's kernels), failing only if a GPU-only dispatcher calls it."""
    if attr.startswith("__"):
        raise AttributeError(attr)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchtitan's triton kernel {attr} needs triton (a GPU); not available here")

    return kernel


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
    import torch.distributed as dist

    backend = backend_for(p)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        _torchtitan_on_cpu()
    dist.init_process_group(backend)
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=p.dp_replicate, dp_shard=p.shard_size, cp=p.cp, tp=p.tp, pp=1, ep=p.ep, world_size=world,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    # Ranks are laid out (batch, cp, tp) row-major: cp and tp neighbours share a data-parallel rank.
    return Dist(rank, world, rank // (p.cp * p.tp), p.dp_size, device, dims, p.cp)


def parallelize(model: nn.Module, d: Dist, p: TrainerParallelConfig, impl: str = "custom") -> None:
    """Tensor parallelism, expert parallelism and FSDP2 (HSDP with dp_replicate > 1) over `model`, in place.
    Checks the sizes against the loaded model first (a `model.path` model's shape is known only now)."""
    if not d.enabled:
        return
    try:
        check_against_model(p, model.cfg, impl)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if d.device.type == "cuda":
        model.to(d.device)
    _refuse_unsupported(p, model)
    if p.tp > 1:  # first: FSDP2 then shards the tensor-parallel DTensors over the data-parallel ranks (2-D)
        apply_tp(model.weights_module(), d.dims.get_mesh("tp"))  # type: ignore[operator]
    if p.world_size > p.tp:  # data-parallel or cp ranks (FSDP2's `fsdp` axis is dp_shard x cp)
        _apply_fsdp(model, d, p)


def _apply_fsdp(model: nn.Module, d: Dist, p: TrainerParallelConfig) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    mesh = d.dims.get_mesh(["dp_replicate", "fsdp"] if p.dp_replicate > 1 else "fsdp")
    kwargs: dict[str, Any] = {"mesh": mesh}
    if d.device.type == "cuda":  # bf16 compute, fp32 master weights and gradient reduction
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = model.weights_module()  # type: ignore[operator]
    from engines.trainer import expert_parallel

    if p.ep > 1:  # the local experts first: their own FSDP units, excluded from their layer's
        expert_parallel.apply_ep(root, d, kwargs)
    for block in expert_parallel.moe_blocks(root):
        block.every_expert = p.ep == 1  # (EP's exchange runs every local expert itself)
    for layer in decoder_layers(root):
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    disable_fsdp_gradient_division(root)
    if d.device.type == "cpu":  # gloo has no PREMUL_SUM / AVG reductions
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def _refuse_unsupported(p: TrainerParallelConfig, model: nn.Module) -> None:
    """What the mesh could express but this trainer does not run (yet): TP on MoE layers (so also TP with
    EP), CP with TP or on MoE models (so also CP with EP); the config's rules, refused at load too."""
    from engines.trainer import context_parallel

    context_parallel.refuse_unsupported(p, model)
    try:
        check_tp(p, model.cfg)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


# torch's tensor-parallel styles per decoder block, as torchtitan's llama `apply_tp` without sequence
# parallelism: q/k/v and gate/up split their output features (heads, MLP width), o/down their input
# features and all-reduce their output. Embeddings, norms and lm_head stay replicated (plain tensors).
_TP_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_TP_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def apply_tp(root: nn.Module, tp_mesh: Any) -> None:
    """Tensor parallelism over `tp_mesh` in place: each rank keeps 1/tp of the heads and MLP width, and the
    attention sees its local heads (engines/models/decoder.py infers the head count from the projection's width)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {name: ColwiseParallel() for name in _TP_COLWISE}
    plan |= {name: RowwiseParallel() for name in _TP_ROWWISE}
    for layer in decoder_layers(root):
        parallelize_module(layer, tp_mesh, plan)


def sum_head_norm_grads(model: nn.Module, d: Dist) -> None:
    """Qwen3's per-head q_norm/k_norm weights are replicated over the tp ranks but each rank's gradient
    covers only its own heads: sum them over the tp group (after FSDP2's reduction over the data-parallel
    ranks, on each rank's shard), so every tp rank steps with the whole gradient."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    group = d.dims.get_mesh("tp").get_group()
    for layer in decoder_layers(model.weights_module()):  # type: ignore[operator]
        attn: Any = layer.self_attn
        for norm in (attn.q_norm, attn.k_norm):
            grad = None if norm is None else norm.weight.grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def decoder_layers(root: nn.Module) -> list[nn.Module]:
    """The decoder blocks (the `layers` ModuleList of rollflow's or transformers' model): one FSDP unit each."""
    for name, m in root.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(m, nn.ModuleList):
            return list(m)
    raise ValueError(f"{type(root).__name__}: no `layers` ModuleList to shard per block")


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


def full_state_dict(model: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """The publishable weights: on one process the model's own; sharded, gathered by every rank (a collective),
    kept on rank 0 only (the other ranks get an empty dict)."""
    if not d.enabled:
        return model.publishable_state_dict()  # type: ignore[operator]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model.weights_module(), options=opts)  # type: ignore[operator]
    if d.dims.ep_enabled:  # each rank holds its share of the experts: gather them all to rank 0
        from engines.trainer import expert_parallel

        sd |= expert_parallel.gather_experts(model.weights_module(), d)  # type: ignore[operator]
    if model.cfg.tie_word_embeddings:  # type: ignore[union-attr]
        sd.pop("lm_head.weight", None)
    return sd  # type: ignore[return-value]


def clip_grad_norm(model: nn.Module, max_norm: float, d: Dist) -> float:
    """Global gradient norm clipping; torchtitan's version reduces the norm over the sharded parameters."""
    if not d.enabled:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if d.dims.tp_enabled:
        sum_head_norm_grads(model, d)  # the gradients are whole only after this
        return _clip_mixed(list(model.parameters()), max_norm)
    from torchtitan.distributed.utils import clip_grad_norm_

    from engines.trainer import expert_parallel

    if d.dims.ep_enabled:  # torchtitan's EP variant expects its own DTensor experts on an `ep` mesh
        return expert_parallel.clip_grad_norm(model, max_norm, d)
    expert_parallel.drop_unrouted_grads(model.weights_module(), d)  # type: ignore[operator]
    return float(clip_grad_norm_(list(model.parameters()), max_norm))


def _clip_mixed(params: list[nn.Parameter], max_norm: float) -> float:
    """With tensor parallelism: parameters on the tp mesh, on the 2-D (data-parallel, tp) mesh, on the
    data-parallel mesh alone, or plain, whose norms torch's foreach kernels will not take in one list: one
    norm per mesh, made whole over it; the total counts each replicated gradient once."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g]) for g in groups.values()]  # type: ignore[misc]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    for g in groups.values():
        if g:
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, total)
    return float(total)


def barrier(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.destroy_process_group()
