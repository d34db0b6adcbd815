"""Context parallelism (`trainer.parallel.cp`): each of the `cp` ranks of a group trains on part of every row's tokens.

Data flow per micro-batch: a `Batch` (one sample per row) or `PackedBatch` (several, block-diagonal causal
mask) -> `to_packed_layout` (per-token tensors, one segment per unpacked row), padded to a multiple of
2 x cp -> torchtitan's `cp_shard` with torch's head-tail load balancer (rank r keeps chunks r and
2cp-1-r of every row, the same split torchtitan gives its SDPA models) -> `CPShard`, whose
`attention_mask` is [rows, 1, local tokens, all tokens], built from the global token indices and the
segment ids -> the model's forward under `gathered_kv`, which all-gathers each layer's keys and values
along the sequence over the `cp` group (torch's differentiable `flex_cp_allgather`: a reduce-scatter of
their gradients in backward) before SDPA -> the loss on the local tokens only.

Why an all-gather and not torch's ring SDPA: ring attention takes no attention mask (causal only), and
the trainer packs several samples per row. The all-gather costs the same bytes as a ring pass, but each
rank holds the whole row's K/V of one layer at a time (activations still split 1/cp elsewhere).

The loss needs nothing more: every rank divides by the step's global completion-token count and FSDP
(whose `fsdp` mesh axis is dp_shard x cp) sums the gradients, so the cp ranks' partial losses add up to
the one-process loss. Statistics (loss, masked tokens, KL sums) are summed over cp (`distributed.all_reduce`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from config.trainer_parallel import TrainerParallelConfig, check_cp
from engines.trainer import compat
from engines.trainer.batch import Batch, PackedBatch, span_mask
from engines.trainer.distributed import Dist

PAD_ID = 0  # any valid token id: padded positions are never scored and attend only to themselves


@dataclasses.dataclass
class CPShard(PackedBatch):
    """This rank's tokens of a packed micro-batch, plus what its attention needs of the whole rows:
    `query_index` [L_local] global positions in the row, `key_index` [L] and `key_segments` [R, L] the
    global index and segment of each key in the order the all-gather returns them."""

    query_index: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    key_index: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    key_segments: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def attention_mask(self) -> torch.Tensor:
        """[R, 1, L_local, L] bool: `PackedBatch.attention_mask`'s rows for this rank's queries."""
        q_seg, k_seg = self.segments[:, :, None], self.key_segments[:, None, :]
        return span_mask(q_seg, k_seg, None, None, self.query_index, self.key_index)


def refuse_unsupported(p: TrainerParallelConfig, model: nn.Module) -> None:
    """At trainer start too (a `model.path` model's shape is known only now): `check_cp`'s rule."""
    try:
        check_cp(p, model.cfg)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def to_packed_layout(mb: Batch | PackedBatch) -> PackedBatch:
    """The packed layout of a micro-batch: an unpacked row becomes one segment covering all its tokens (its
    right padding too, as the plain causal forward lets padding attend), targets and masks padded by one."""
    if isinstance(mb, PackedBatch):
        return mb
    rows, length = mb.input_ids.shape
    device = mb.input_ids.device

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t[:, None].expand(rows, length).contiguous()

    return PackedBatch(
        input_ids=mb.input_ids,
        positions=torch.arange(length, device=device).expand(rows, length).contiguous(),
        segments=torch.zeros(rows, length, dtype=torch.long, device=device),
        targets=F.pad(mb.targets, (0, 1), value=PAD_ID),
        loss_mask=F.pad(mb.loss_mask, (0, 1)),
        sampler_logprobs=F.pad(mb.sampler_logprobs, (0, 1)),
        advantages=F.pad(mb.advantages, (0, 1)) if mb.advantages.dim() == 2 else per_token(mb.advantages),
        temperatures=per_token(mb.temperatures),
        routes=None,
        kept=None if mb.kept is None else F.pad(mb.kept, (0, 1)),
    )


def _padded(mb: PackedBatch, multiple: int) -> PackedBatch:
    """Rows extended to a multiple of `multiple` tokens with padding (segment -1, never scored)."""
    extra = -mb.input_ids.shape[1] % multiple
    if not extra:
        return mb
    fills = {"segments": -1, "temperatures": 1.0, "input_ids": PAD_ID, "targets": PAD_ID}
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(PackedBatch) if f.name != "routes"}
    fields = {k: v for k, v in fields.items() if v is not None}  # kept: None without truncation
    return PackedBatch(**{k: F.pad(v, (0, extra), value=fills.get(k, 0)) for k, v in fields.items()})


def shard(mb: Batch | PackedBatch, d: Dist) -> Batch | PackedBatch:
    """This rank's part of every row of `mb` (torchtitan's `cp_shard`, head-tail load balanced); `mb`
    unchanged without context parallelism."""
    if d.cp == 1:
        return mb
    # (its module imports torchtitan's GPU EP kernels by name: on a CPU they come from compat.torchtitan_on_cpu)
    from torchtitan.distributed.context_parallel.api import cp_shard

    if mb.routes is not None:
        raise SystemExit("trainer.parallel.cp > 1 with MoE routing records is not supported; set cp = 1")
    if isinstance(mb, PackedBatch) and mb.prefixes is not None:  # CPShard's mask has no shared prompts
        raise RuntimeError("a micro-batch with shared prompts reached context parallelism (the layout shares none)")
    if isinstance(mb, Batch) and mb.pixels is not None:  # an image's tokens must stay on one rank with its pixels
        raise SystemExit("trainer.parallel.cp > 1 with a vision-language model is not supported; set cp = 1")
    full = _padded(to_packed_layout(mb), 2 * d.cp)
    rows, length = full.input_ids.shape
    mesh = d.dims.get_mesh("cp")
    names = [f.name for f in dataclasses.fields(PackedBatch) if f.name != "routes"]
    names = [n for n in names if getattr(full, n) is not None]  # kept: None without truncation
    index = torch.arange(length, device=full.input_ids.device).expand(rows, length)
    local, _ = cp_shard(mesh, (*[getattr(full, n) for n in names], index), None, "headtail")
    # the all-gather concatenates the ranks' chunks in rank order: the load balancer's order of the row
    order = compat.head_tail_order(length, d.cp, mesh.device_type).to(index.device)
    if not torch.equal(local[-1][0], order.view(d.cp, -1)[mesh.get_local_rank()]):
        raise RuntimeError("cp_shard's split differs from the head-tail order the K/V all-gather assumes")
    return CPShard(
        **dict(zip(names, local[:-1], strict=True)),
        query_index=local[-1][0],
        key_index=order,
        key_segments=full.segments[:, order],
    )


class _GatherKV(TorchFunctionMode):
    """Every `scaled_dot_product_attention` inside sees the keys and values of the whole row: this rank's
    [B, H, L_local, D] gathered along dim 2 over the cp group (in rank order, differentiable)."""

    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            k, v = compat.flex_cp_allgather(k.contiguous(), v.contiguous(), 2, self.group_name)
            args = (q, k, v, *rest)
        return func(*args, **kwargs)


@contextlib.contextmanager
def gathered_kv(d: Dist) -> Iterator[None]:
    """The forward of a `shard`ed micro-batch runs inside this; a no-op without context parallelism."""
    if d.cp == 1:
        yield
        return
    with _GatherKV(compat.process_group_name(d.dims.get_mesh("cp").get_group())):
        yield
