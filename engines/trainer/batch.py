"""Turn a step's rollout table into right-padded training tensors, split into micro-batches.

`pack_batch` repacks the same samples several to a row (`trainer.packing`), which removes most padding
when completion lengths vary. MoE routing payloads (`routed_experts`, [prompt + completion - 1, layers, k])
become `routes` [B, T, layers, k] aligned with `input_ids`; positions without a payload (the last token,
padding, samples without routes) hold -1, which router replay reads as "route afresh".
The sampler's kept support sizes (`completion_kept`, top-k / top-p truncation) become `kept` aligned with
`targets`: 0 where the target was not drawn from a truncated distribution (full vocabulary); None when no
sample in the batch carries them (or trainer.keep_sampling_mask is off).
Per-token advantages (`token_advantages`, on-policy distillation) make `advantages` [B, T-1] aligned with
`targets`, a sample without them carrying its scalar `advantage` on each completion token; without any, it
stays [B].
Rows with images (a vision-language policy: `make_batch(..., spec)`) carry their vision encoder inputs per row
(`pixels`, engines/trainer/vision_batch.py) and their image counts; `Batch.vision()` joins a micro-batch's.
Packing leaves such batches as they are (`packable`): a packed row would need per-span multimodal positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import torch

if TYPE_CHECKING:
    from engines.models.vision import VisionInputs, VisionSpec


def _rows_of(fields: dict[str, Any], idx: torch.Tensor | slice) -> dict[str, Any]:
    """The given rows of every tensor (or per-row list) field; absent optional fields (None) stay None."""

    def rows(v: Any) -> Any:
        if isinstance(v, list) and isinstance(idx, torch.Tensor):
            return [v[i] for i in idx.tolist()]
        return v[idx]

    return {k: None if v is None else rows(v) for k, v in fields.items()}


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    targets: torch.Tensor  # [B, T-1] next tokens
    loss_mask: torch.Tensor  # [B, T-1] 1.0 where the target is a model-sampled completion token
    sampler_logprobs: torch.Tensor  # [B, T-1] sampler logprob of each completion target, 0 elsewhere
    advantages: torch.Tensor  # [B], or [B, T-1] per target when the step carries token advantages
    temperatures: torch.Tensor  # [B]
    versions: torch.Tensor  # [B] policy_version
    versions_end: torch.Tensor  # [B] policy_version_end
    routes: torch.Tensor | None = None  # [B, T, layers, k] sampler's expert ids, -1 where none
    kept: torch.Tensor | None = None  # [B, T-1] int64 sampler's kept support size per target, 0 = full vocabulary
    pixels: list[VisionInputs | None] | None = None  # per row: its images' encoder inputs (None: no image)
    image_counts: torch.Tensor | None = None  # [B] images per row (a vision-language policy's batch)
    images_dropped: torch.Tensor | None = None  # [B] bool: rows whose images failed their checks (train nothing)
    # [B, T-1] the tokens whose mismatch_kl the loss's first forward measures (engines/trainer/rl.py); None: none
    measured: torch.Tensor | None = None
    # [B] tokens per row (prompt + completion, images' included): what micro_batches keeps; None: the full width
    lengths: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None  # [B] prompt tokens per row: what prefix sharing groups by

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> Batch:
        return Batch(**_rows_of(self.__dict__, idx))

    def vision(self) -> VisionInputs | None:
        """The encoder inputs of every image of these rows, in row order; None without images."""
        from engines.trainer.vision_batch import concat

        return None if self.pixels is None else concat(self.pixels)

    @property
    def packable(self) -> bool:
        """Whether `pack_batch` may repack it: not a vision-language policy's batch (packing is bypassed: its
        rows stay padded, one sample each, whatever trainer.packing / sft.packing say)."""
        return self.pixels is None


def right_pad(seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
    return ids


def routes_tensor(payloads: list, length: int) -> torch.Tensor | None:
    """[B, length, layers, k] int64 from per-sample [seq, layers, k] lists (None -> -1); None if all are None."""
    shapes = [(len(r[0]), len(r[0][0])) for r in payloads if r]
    if not shapes:
        return None
    layers, k = shapes[0]
    out = torch.full((len(payloads), length, layers, k), -1, dtype=torch.long)
    for i, r in enumerate(payloads):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def kept_tensor(table: pa.Table, shape: tuple[int, int]) -> torch.Tensor | None:
    """[B, T-1] kept support sizes aligned with the targets (0 elsewhere), from `completion_kept`; None when the
    column is absent (a version-2 shard) or null in every row (no truncation)."""
    if "completion_kept" not in table.column_names or table.column("completion_kept").null_count == table.num_rows:
        return None
    out = torch.zeros(shape, dtype=torch.long)
    prompts = table.column("prompt_ids").to_pylist()
    for i, (p, kept) in enumerate(zip(prompts, table.column("completion_kept").to_pylist(), strict=True)):
        if kept:
            out[i, len(p) - 1 : len(p) - 1 + len(kept)] = torch.tensor(kept, dtype=torch.long)
    return out


def advantages_tensor(table: pa.Table, shape: tuple[int, int]) -> torch.Tensor:
    """[B] the samples' advantages; [B, T-1] aligned with the targets when some sample carries
    `token_advantages` (the others' scalar on each of their completion tokens, 0 elsewhere)."""
    scalar = torch.tensor(table.column("advantage").to_pylist(), dtype=torch.float32)
    if "token_advantages" not in table.column_names or table.column("token_advantages").null_count == table.num_rows:
        return scalar
    out = torch.zeros(shape)
    cols = (table.column("prompt_ids").to_pylist(), table.column("completion_ids").to_pylist())
    for i, (p, c, tokens) in enumerate(zip(*cols, table.column("token_advantages").to_pylist(), strict=True)):
        values = torch.tensor(tokens, dtype=torch.float32) if tokens is not None else scalar[i].expand(len(c))
        out[i, len(p) - 1 : len(p) - 1 + len(c)] = values
    return out


def make_batch(table: pa.Table, pad_id: int, keep_sampling_mask: bool = True, spec: VisionSpec | None = None) -> Batch:
    """The step's samples as right-padded tensors; `keep_sampling_mask` false drops the kept support sizes
    (every target scored on the full vocabulary). With a vision-language policy's `spec`, each row's images
    (checked; a failing row is dropped: engines/trainer/vision_batch.py)."""
    cols = table.select(
        ["prompt_ids", "completion_ids", "completion_logprobs", "advantage", "temperature"]
        + ["policy_version", "policy_version_end"]
    ).to_pydict()
    seqs = [p + c for p, c in zip(cols["prompt_ids"], cols["completion_ids"], strict=True)]
    ids = right_pad(seqs, pad_id)
    mask = torch.zeros((ids.shape[0], ids.shape[1] - 1))
    sampler = torch.zeros_like(mask)
    # multi-turn episodes mark environment tokens 0 (never trained); a null mask (or a shard written before
    # the column existed) means every completion token is a model token
    turn_masks = table.column("completion_mask").to_pylist() if "completion_mask" in table.column_names else None
    for i, (p, lps) in enumerate(zip(cols["prompt_ids"], cols["completion_logprobs"], strict=True)):
        start = len(p) - 1  # target index of the first completion token
        m = turn_masks[i] if turn_masks is not None else None
        mask[i, start : start + len(lps)] = 1.0 if m is None else torch.tensor(m, dtype=torch.float32)
        sampler[i, start : start + len(lps)] = torch.tensor(lps)
    batch = Batch(
        input_ids=ids,
        targets=ids[:, 1:],
        loss_mask=mask,
        sampler_logprobs=sampler,
        advantages=advantages_tensor(table, (mask.shape[0], mask.shape[1])),
        temperatures=torch.tensor(cols["temperature"], dtype=torch.float32),
        versions=torch.tensor(cols["policy_version"]),
        versions_end=torch.tensor(cols["policy_version_end"]),
        routes=routes_tensor(table.column("routed_experts").to_pylist(), ids.shape[1])
        if "routed_experts" in table.column_names
        else None,
        kept=kept_tensor(table, (mask.shape[0], mask.shape[1])) if keep_sampling_mask else None,
        lengths=torch.tensor([len(s) for s in seqs]),
        prompt_lengths=torch.tensor([len(p) for p in cols["prompt_ids"]]),
    )
    return batch if spec is None else with_images(batch, table, spec, pad_id)


def with_images(batch: Batch, table: pa.Table, spec: VisionSpec, pad_id: int) -> Batch:
    """The batch with its rows' images (engines/trainer/vision_batch.py); a dropped row's image tokens blanked
    and its loss mask zeroed."""
    from engines.trainer import vision_batch

    rows = vision_batch.row_images(table, spec)
    dropped = torch.tensor([r.dropped is not None for r in rows], dtype=torch.bool)
    if bool(dropped.any()):
        batch.input_ids[dropped] = vision_batch.blank(batch.input_ids[dropped], spec, pad_id)
        batch.loss_mask[dropped] = 0.0
    batch.pixels = vision_batch.pixels_of(rows, spec)
    batch.image_counts = torch.tensor([len(r.images) for r in rows], dtype=torch.long)
    batch.images_dropped = dropped
    return batch


@dataclass
class PackedBatch:
    """Several samples per row, so rows carry little padding; per-token tensors replace per-sample ones.

    A sample occupies one contiguous span of a row. Positions restart at 0 in every span and
    `segments` (span index, -1 for padding) drives a block-diagonal causal mask, so each token attends
    only to earlier tokens of its own sample: logprobs equal the padded batch's.
    With prefix sharing (`Unit.shared`) a group's common prompt sits once before its samples' spans (segment -1,
    `prefixes` >= 0), each span then holding the rest of its sample from position `shared` on and attending to
    that prompt as well as to itself: the same logprobs, the prompt's tokens computed once.
    """

    input_ids: torch.Tensor  # [R, L]
    positions: torch.Tensor  # [R, L] position within the sample
    segments: torch.Tensor  # [R, L] sample index within the row, -1 on padding and shared prompts
    targets: torch.Tensor  # [R, L] next token of the same sample (pad where there is none)
    loss_mask: torch.Tensor  # [R, L] 1.0 where the target is a completion token
    sampler_logprobs: torch.Tensor  # [R, L]
    advantages: torch.Tensor  # [R, L] the sample's advantage on each of its tokens
    temperatures: torch.Tensor  # [R, L] the sample's temperature on each of its tokens
    routes: torch.Tensor | None = None  # [R, L, layers, k] sampler's expert ids, -1 where none
    kept: torch.Tensor | None = None  # [R, L] sampler's kept support size per target, 0 = full vocabulary
    measured: torch.Tensor | None = None  # [R, L] as `Batch.measured`
    # [R, L] the shared prompt (numbered within the row) a token belongs to or reads, -1 where none; None: no row
    # shares one
    prefixes: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> PackedBatch:
        return PackedBatch(**_rows_of(self.__dict__, idx))

    def real(self) -> torch.Tensor:
        """[R, L] bool: a sample's token or a shared prompt's, not padding."""
        return self.segments >= 0 if self.prefixes is None else (self.segments >= 0) | (self.prefixes >= 0)

    def attention_mask(self) -> torch.Tensor:
        """[R, 1, L, L] bool: causal within a sample (and its shared prompt), nothing across samples."""
        length = self.segments.shape[1]
        index = torch.arange(length)
        keys = None if self.prefixes is None else self.prefixes[:, None, :]
        queries = None if self.prefixes is None else self.prefixes[:, :, None]
        return span_mask(self.segments[:, :, None], self.segments[:, None, :], queries, keys, index, index)


def span_mask(
    q_seg: torch.Tensor,
    k_seg: torch.Tensor,
    q_prefix: torch.Tensor | None,
    k_prefix: torch.Tensor | None,
    q_index: torch.Tensor,
    k_index: torch.Tensor,
) -> torch.Tensor:
    """[R, 1, Lq, Lk] bool from broadcastable [R, Lq, 1] / [R, 1, Lk] segments and shared-prompt ids and the
    queries' and keys' positions in the row: a query sees earlier keys of its own sample and of the shared prompt
    it reads; a padding query sees itself only, so no softmax row is empty (which would give NaN)."""
    visible = (q_seg == k_seg) & (q_seg >= 0)
    if q_prefix is not None and k_prefix is not None:
        visible = visible | ((k_seg < 0) & (k_prefix >= 0) & (q_prefix == k_prefix))
    causal = k_index[None, None, :] <= q_index[None, :, None]
    itself = k_index[None, None, :] == q_index[None, :, None]
    return ((visible & causal) | itself)[:, None]


@dataclass(frozen=True)
class Unit:
    """What `pack_batch` places as one run of a row: each of `members`' samples from token `shared` on, after
    (shared > 0) those first `shared` tokens once, the prompt the members begin with (prefix sharing)."""

    members: tuple[int, ...]
    shared: int = 0

    def size(self, lengths: list[int]) -> int:
        return self.shared + sum(lengths[i] - self.shared for i in self.members)


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, each row's lengths summing to <= capacity."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        slot = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if slot is None:
            rows.append([])
            free.append(capacity)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= lengths[i]
    return rows


def sample_lengths(batch: Batch) -> list[int]:
    """Prompt + completion tokens per sample: the last completion target sits at index length - 2.

    Read from the loss mask, not from pad ids: a sampler may emit the pad token inside a completion.
    Multi-turn episodes always end on a model token (storage/rollouts.check_episode), so this holds for them.
    """
    last = torch.arange(batch.loss_mask.shape[1]) * (batch.loss_mask > 0)
    return (last.max(-1).values + 2).tolist()


class _Spans:
    """Where each token of a packed batch comes from: per token its row and column, its sample and index in that
    sample, its segment and shared prompt; `pack_batch` gathers every field with these in one indexing each."""

    def __init__(self) -> None:
        self.cols: dict[str, list[int]] = {k: [] for k in ("row", "col", "sample", "token", "segment", "prefix")}
        self.target: list[bool] = []

    def add(self, row: int, at: int, sample: int, tokens: range, segment: int, prefix: int, length: int) -> int:
        """Sample `sample`'s `tokens` from column `at` of `row`; those before its last (`length` - 1) have
        targets. Returns the next free column."""
        n = len(tokens)
        per_token = {"row": [row] * n, "col": range(at, at + n), "sample": [sample] * n, "token": tokens}
        for name, values in {**per_token, "segment": [segment] * n, "prefix": [prefix] * n}.items():
            self.cols[name].extend(values)
        self.target.extend(t < length - 1 for t in tokens)
        return at + n

    def gather(self, batch: Batch, pad_id: int, shape: tuple[int, int], sharing: bool) -> PackedBatch:
        idx = {k: torch.tensor(v, dtype=torch.long) for k, v in self.cols.items()}
        where, src = (idx["row"], idx["col"]), (idx["sample"], idx["token"])
        has = torch.tensor(self.target, dtype=torch.bool)
        where_t, src_t = (where[0][has], where[1][has]), (src[0][has], src[1][has])

        def tokens(fill: float | int, values: torch.Tensor) -> torch.Tensor:
            out = torch.full(shape, fill, dtype=values.dtype)
            out[where] = values
            return out

        def targets(whole: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            out = torch.full(shape, fill, dtype=whole.dtype)
            out[where_t] = whole[src_t]
            return out

        routes = None
        if batch.routes is not None:
            routes = torch.full((*shape, *batch.routes.shape[2:]), -1, dtype=torch.long)
            routes[where] = batch.routes[src]
        advantages = batch.advantages
        return PackedBatch(
            input_ids=tokens(pad_id, batch.input_ids[src]),
            positions=tokens(0, idx["token"]),
            segments=tokens(-1, idx["segment"]),
            prefixes=tokens(-1, idx["prefix"]) if sharing else None,
            targets=targets(batch.targets, pad_id),
            loss_mask=targets(batch.loss_mask),
            sampler_logprobs=targets(batch.sampler_logprobs),
            # per target when the step carries token advantages, else the sample's on each of its tokens
            advantages=targets(advantages) if advantages.dim() == 2 else tokens(0, advantages[src[0]]),
            temperatures=tokens(1.0, batch.temperatures[src[0]]),
            routes=routes,
            kept=None if batch.kept is None else targets(batch.kept),
            measured=None if batch.measured is None else targets(batch.measured),
        )


def pack_batch(batch: Batch, pad_id: int, capacity: int | None = None, units: list[Unit] | None = None) -> PackedBatch:
    """Pack a right-padded `Batch` into rows of `capacity` tokens (default: its longest unit); `units` (default:
    each sample alone) say which samples share their prompt (engines/trainer/layout.py)."""
    if not batch.packable:
        raise ValueError("a vision-language policy's batch is not packed (Batch.packable); train it padded")
    lengths = sample_lengths(batch)
    units = units if units is not None else [Unit((i,)) for i in range(len(batch))]
    sizes = [u.size(lengths) for u in units]
    capacity = capacity or max(sizes)
    rows = pack_rows(sizes, capacity)
    spans = _Spans()
    for r, members in enumerate(rows):
        at, segment = 0, 0
        for p, unit in enumerate(units[u] for u in members):
            prefix = p if unit.shared else -1
            if unit.shared:
                first = unit.members[0]
                at = spans.add(r, at, first, range(unit.shared), -1, prefix, lengths[first])
            for i in unit.members:
                at = spans.add(r, at, i, range(unit.shared, lengths[i]), segment, prefix, lengths[i])
                segment += 1
    return spans.gather(batch, pad_id, (len(rows), capacity), any(u.shared for u in units))


B = TypeVar("B", Batch, PackedBatch)


def micro_batches(batch: B, size: int) -> list[B]:
    """Slices of `size` rows (samples, or packed rows of several samples). A padded batch's rows go shortest
    first and each slice drops the padding columns none of its rows reaches, so a forward costs about its real
    tokens rather than rows x the step's longest sample (on the tiny profile's steps, 4.5k against 6.4k). Every
    loss sums per token (sample_index groups within a slice), so the grouping changes only the rounding."""
    if isinstance(batch, Batch) and batch.lengths is not None and len(batch) > size:
        batch = batch.select(torch.argsort(batch.lengths, stable=True))
    slices = [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]
    return [trim_padding(mb) if isinstance(mb, Batch) else mb for mb in slices]


def trim_padding(batch: Batch) -> Batch:
    """`batch` cut to its longest row (`lengths`): every [B, T] and [B, T-1] field loses the columns only padding
    fills; a batch without `lengths` stays whole."""
    if batch.lengths is None or len(batch) == 0:
        return batch
    length = max(2, int(batch.lengths.max()))
    if length >= batch.input_ids.shape[1]:
        return batch
    cut = dict(batch.__dict__)
    cut["input_ids"] = batch.input_ids[:, :length]
    if batch.routes is not None:
        cut["routes"] = batch.routes[:, :length]
    for name in ("targets", "loss_mask", "sampler_logprobs", "kept", "measured"):
        if cut[name] is not None:
            cut[name] = cut[name][:, : length - 1]
    if batch.advantages.dim() == 2:
        cut["advantages"] = batch.advantages[:, : length - 1]
    return Batch(**cut)


def sample_index(mb: Batch | PackedBatch) -> torch.Tensor:
    """[rows, T] long aligned with `loss_mask`: which sample of the micro-batch each position belongs to
    (a padded row is one sample; a packed row's spans are samples numbered after the previous rows'), -1 on
    padding. The sequence-level losses and the sequence_mean aggregation group tokens by it."""
    rows, length = mb.loss_mask.shape
    if not isinstance(mb, PackedBatch):
        return torch.arange(rows)[:, None].expand(rows, length).clone()
    per_row = mb.segments.max(dim=1).values + 1
    offsets = torch.cumsum(per_row, 0) - per_row
    return torch.where(mb.segments >= 0, mb.segments + offsets[:, None], -1)
