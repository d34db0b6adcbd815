"""Expert parallelism (`trainer.parallel.ep`) for rollflow's MoE blocks, with torchtitan's token dispatcher.

Data flow per MoE layer on each rank of an `ep` group: route as on one process (routing record and router
replay unchanged) -> torchtitan's `AllToAllTokenDispatcher.dispatch` (token counts, then the tokens, over
the `ep` mesh with torch's functional `all_to_all_single`, whose backward is the reverse all-to-all) ->
this rank's experts run on their contiguous chunks -> `combine` (the reverse all-to-all; the gate weights
are applied there, once, in fp32, and the k outputs of a token are scatter-added) -> the block's output.

Layout: the `ep` ranks own contiguous expert ranges; the other experts of the `experts` ModuleList are
parameterless `Elsewhere` placeholders, so the local experts keep their global Hugging Face names
(`mlp.experts.5.gate_proj.weight`) in state dicts, optimizer state and DCP checkpoints. The local experts of
a layer form one FSDP2 unit over torchtitan's expert data-parallel mesh (`efsdp`, x `dp_replicate` for HSDP),
before their layer is sharded over `fsdp`. Gradients stay sums. Publication gathers every expert to rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engines.models.moe import SparseMoeBlock
from engines.trainer.distributed import Dist


class Elsewhere(nn.Module):
    """Stands in for an expert another `ep` rank holds: no parameters, never called."""

    def __init__(self, owner: int):
        super().__init__()
        self.owner = owner

    def extra_repr(self) -> str:
        return f"on ep rank {self.owner}"


class Exchange:
    """The expert half of one `SparseMoeBlock` forward under EP: `(block, x [N, H], ids [N, k], weights [N, k])
    -> [N, H]`, through torchtitan's all-to-all dispatcher over the `ep` mesh. The tokens each local expert
    received are added to the block's `routed` counts (see `drop_unrouted_grads`)."""

    def __init__(self, num_experts: int, top_k: int, ep_mesh: Any, local: range):
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        self.num_experts, self.local = num_experts, local
        self.dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
        self.dispatcher.wire_meshes(ep_mesh=ep_mesh)

    def __call__(
        self, block: SparseMoeBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        routed, per_local, meta = self.dispatcher.dispatch(x, weights, ids, counts)
        if torch.is_grad_enabled():  # (a forward without backward makes no gradient to drop)
            block.routed[self.local.start : self.local.stop] += per_local.cpu()
        # Every local expert runs, on an empty chunk too: each rank then builds the same autograd graph, so
        # FSDP's hooks (and their collectives) fire in the same order on every rank. A skipped expert made
        # one rank prefetch the previous layer (an all-gather) while its peer waited in the backward
        # all-to-all: a deadlock, seen in a real run.
        chunks = routed.split(per_local.tolist())
        out = torch.cat([block.experts[e](c) for e, c in zip(self.local, chunks, strict=True)])
        return self.dispatcher.combine(out, meta, x)


def moe_blocks(root: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in root.modules() if isinstance(m, SparseMoeBlock)]


def apply_ep(root: nn.Module, d: Dist, fsdp_kwargs: dict[str, Any]) -> None:
    """Keep this rank's contiguous share of each MoE layer's experts, route through the all-to-all exchange,
    and shard the local experts (one FSDP2 unit per layer) over the expert data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import utils as tt_dist

    tt_dist.set_spmd_backend(d.dims.spmd_backend)  # the dispatcher then uses torch's all_to_all_single
    ep_mesh = d.dims.get_mesh("ep")
    efsdp_mesh = expert_mesh(d)
    ep_rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for block in moe_blocks(root):
        n = len(block.experts) // ep
        local = range(ep_rank * n, (ep_rank + 1) * n)
        for i in range(len(block.experts)):
            if i not in local:
                block.experts[i] = Elsewhere(i // n)
        block.exchange = Exchange(len(block.experts), block.top_k, ep_mesh, local)
        fully_shard([block.experts[i] for i in local], **{**fsdp_kwargs, "mesh": efsdp_mesh})


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in f".{name}"


def gather_experts(root: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """Every expert's full weights (CPU) on rank 0, under their global names; {} elsewhere. A collective:
    full tensors over the expert data-parallel mesh, then a gather over each `ep` group (whose rank r holds
    experts r * n ... r * n + n - 1 of every layer)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    ep_mesh = d.dims.get_mesh("ep")
    group, ep, first = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for prefix, block in root.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        n = len(block.experts) // ep
        for j, e in enumerate(block.exchange.local):  # type: ignore[union-attr]
            for name, p in block.experts[e].named_parameters():
                full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                parts = [torch.empty_like(full) for _ in range(ep)] if first else None
                dist.gather(full, parts, group=group, group_dst=0)
                if d.is_main and parts is not None:
                    out |= {f"{prefix}.experts.{r * n + j}.{name}": t.cpu() for r, t in enumerate(parts)}
    return out


def expert_mesh(d: Dist) -> Any:
    """The ranks an expert's gradient is reduced over: with EP, the expert data-parallel axis `efsdp` (x
    `dp_replicate` for HSDP); without, FSDP2's data-parallel axes (MoE models run no tp or cp)."""
    shard = "efsdp" if d.dims.ep_enabled else "fsdp"
    return d.dims.get_mesh(["dp_replicate", shard] if d.dims.dp_replicate > 1 else shard)


def drop_unrouted_grads(root: nn.Module, d: Dist) -> None:
    """After the step's backward passes: no gradient for an expert no token reached in the step on any rank
    sharing its gradient. On one process such an expert is never called, so AdamW leaves it alone (no weight
    decay, no step count); here it ran on no tokens (to keep the ranks' collectives in step) and holds a
    zero gradient. Resets the blocks' token counts for the next step."""
    if not d.enabled:
        return
    import torch.distributed as dist

    mesh = expert_mesh(d)
    for block in moe_blocks(root):
        routed = block.routed.to(d.device)
        for dim in range(mesh.ndim):  # summed over every axis of the mesh
            if mesh.size(dim) > 1:
                dist.all_reduce(routed, group=mesh.get_group(dim))
        for expert, n in zip(block.experts, routed.tolist(), strict=True):
            if n == 0:  # (an EP placeholder for another rank's expert has no parameters)
                for p in expert.parameters():
                    p.grad = None
        block.routed.zero_()


def clip_grad_norm(model: nn.Module, max_norm: float, d: Dist) -> float:
    """Global gradient norm with EP: the dense gradients' norm over `fsdp`, the experts' over `efsdp` and then
    summed over the `ep` group (each rank holds different experts, so each expert counts once). Runs after
    the step's backward passes, so it first drops the gradients of experts no token reached."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    drop_unrouted_grads(model.weights_module(), d)  # type: ignore[operator]
    groups: dict[bool, list[nn.Parameter]] = {True: [], False: []}
    for name, p in model.weights_module().named_parameters():  # type: ignore[operator]
        if p.grad is not None:
            groups[is_expert_param(name)].append(p)
    squares = []
    for expert, params in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())  # type: ignore[misc]
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        square = norm.to(torch.float64) ** 2
        if expert:
            dist.all_reduce(square, group=d.dims.get_mesh("ep").get_group())
        squares.append(square)
    total = sum(squares).sqrt().to(torch.float32)  # type: ignore[union-attr]
    for params in groups.values():
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
