"""The trainer's model over torchtitan's device mesh: tensor, expert and data parallelism (FSDP2), clipping, gathering.

Data flow: a model and the `Dist` of engines/trainer/distributed.py (its mesh built by `init`) ->
`parallelize` (tensor parallelism first, over `tp`; MoE experts spread over `ep`
(engines/trainer/expert_parallel.py); then torch's FSDP2 `fully_shard` per decoder layer and at the root,
over the mesh's `fsdp` (dp_shard x cp, + `dp_replicate` for HSDP) axes; torchtitan's
`disable_fsdp_gradient_division`, so gradients are summed: every rank's loss is already divided by the
step's global token count) -> the step runs on each rank's rows (distributed.py; with cp,
engines/trainer/context_parallel.py splits each row's tokens) -> `clip_grad_norm` (first completes the
gradients that need it: q/k norms over tp, unrouted experts dropped) -> `full_state_dict` (all ranks
gather, rank 0 keeps the weights to publish).

With `world_size = 1` every function here is the plain one-process operation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from config.trainer_parallel import TrainerParallelConfig, check_against_model, check_tp
from engines.trainer import context_parallel, expert_parallel
from engines.trainer.distributed import Dist


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


def full_state_dict(model: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """The publishable weights: on one process the model's own; sharded, gathered by every rank (a collective),
    kept on rank 0 only (the other ranks get an empty dict)."""
    if not d.enabled:
        return model.publishable_state_dict()  # type: ignore[operator]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model.weights_module(), options=opts)  # type: ignore[operator]
    if d.dims.ep_enabled:  # each rank holds its share of the experts: gather them all to rank 0
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
