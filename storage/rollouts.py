"""Rollout shards: Arrow IPC files hive-partitioned by step, committed by a manifest written last.

Layout: `OUTPUT_DIR/rollouts/step=NNNNNN/part-00000.arrow` + `_manifest.json`. Any Arrow reader can
open the folder (`pyarrow.dataset.dataset(path, format="ipc", partitioning="hive")`); rollflow's own
reader goes through the manifest and verifies checksums. Columns are documented in docs/rollouts.md.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, get_args, get_origin

import fsspec
import pyarrow as pa
from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from storage.fs import commit_dir, committed_steps, join, read_manifest, read_verified, step_dir

# 2: multi-turn columns (completion_mask, turn_policy_versions[_end]); version-1 shards lack them and read as
# single-turn samples (every completion token a model token).
# 3: completion_kept (per completion token, the support size the sampler's top-k / top-p truncation kept);
# version-2 shards lack it and read as sampled from the full vocabulary (the trainer scores them so).
# 4: teacher_logprobs and token_advantages (on-policy distillation); version-3 shards lack them and read as
# samples without a teacher, every token carrying the sample's `advantage`.
# 5: images and image_sha256 (the prompt's images, in prompt order, and their checksums); version-4 shards lack
# them and read as text-only samples.
SCHEMA_VERSION = 5


class ArrowType:
    """`Annotated` marker: the Arrow type a field is stored as, where Python's type is too wide."""

    def __init__(self, type_: pa.DataType):
        self.type = type_


Int32 = Annotated[int, ArrowType(pa.int32())]
Float32 = Annotated[float, ArrowType(pa.float32())]
Int16 = Annotated[int, ArrowType(pa.int16())]
Int8 = Annotated[int, ArrowType(pa.int8())]


class RolloutRow(BaseModel):
    """One sample as the orchestrator commits it; the shard schema (`ROLLOUT_SCHEMA`) is derived from it.

    Field order is the documented column order (docs/rollouts.md); `step` is also the hive partition key,
    int32 because that is what hive discovery infers from `step=N`. Optional fields are nullable columns.
    """

    model_config = ConfigDict(extra="forbid")

    run_id: str
    step: Int32
    sample_id: str
    group_id: str
    env: str
    policy_version: int
    policy_version_end: int
    prompt_ids: list[Int32]
    completion_ids: list[Int32]
    completion_logprobs: list[Float32]
    reward: Float32
    advantage: Float32 = 0.0  # set by the orchestrator from its group's rewards (environments only score)
    temperature: Float32
    finish_reason: str
    prompt_text: str
    completion_text: str
    # [seq, layers, top_k] expert ids per token for MoE router replay; null for dense models.
    routed_experts: list[list[list[Int16]]] | None = None
    # Multi-turn episodes (engines/environments/episodes.py): `completion_ids` holds every token after the first prompt,
    # model turns and environment/tool responses interleaved; 1 marks a model token (trained, with its
    # sampler logprob), 0 an environment token (logprob 0, never trained). Null: all model tokens.
    completion_mask: list[Int8] | None = None
    # The policy version of each model turn's first and last token; null for single-turn samples.
    turn_policy_versions: list[int] | None = None
    turn_policy_versions_end: list[int] | None = None
    # Named scores from the environment's rubric (verifiers environments: `reward/<name>`, `metric/<name>`),
    # as parallel lists; the trainer averages each name over the step into metrics.jsonl. Null: none.
    metric_names: list[str] | None = None
    metric_values: list[Float32] | None = None
    # Per completion token, how many tokens the sampler's truncated distribution kept (top-k / top-p after
    # temperature): the trainer scores the token on that support (trainer.keep_sampling_mask). 0 on environment
    # tokens of multi-turn rows; null when the sampler did not truncate (full vocabulary).
    completion_kept: list[Int32] | None = None
    # On-policy distillation ([teacher]): per completion token, the teacher's logprob of it given everything
    # before it; null without a teacher.
    teacher_logprobs: list[Float32] | None = None
    # Per completion token, the advantage the trainer uses (kl_coef * (teacher - sampler logprob) + reward_coef *
    # advantage with a teacher); null: `advantage` on every token.
    token_advantages: list[Float32] | None = None
    # The prompt's images (PNG or JPEG bytes, in prompt order: the i-th run of image tokens in `prompt_ids` is
    # image i) and the sha256 of each, which readers check (`verified_images`); null for text-only samples.
    images: list[bytes] | None = None
    image_sha256: list[str] | None = None


_SCALARS: dict[type, pa.DataType] = {
    str: pa.string(),
    int: pa.int64(),
    float: pa.float64(),
    bool: pa.bool_(),
    bytes: pa.binary(),
}


def _arrow_type(annotation: Any) -> pa.DataType:
    if get_origin(annotation) is Annotated:
        base, *meta = get_args(annotation)
        marks = [m for m in meta if isinstance(m, ArrowType)]
        return marks[0].type if marks else _arrow_type(base)
    if get_origin(annotation) is list:
        return pa.list_(_arrow_type(get_args(annotation)[0]))
    return _SCALARS[annotation]


def _arrow_field(name: str, info: FieldInfo) -> pa.Field:
    annotation: Any = info.annotation
    args = get_args(annotation)
    nullable = type(None) in args
    if nullable:
        annotation = next(a for a in args if a is not type(None))
    if info.metadata:  # pydantic moves Annotated metadata of a top-level field here
        annotation = Annotated[(annotation, *info.metadata)]
    return pa.field(name, _arrow_type(annotation), nullable=nullable)


ROLLOUT_SCHEMA = pa.schema(
    [_arrow_field(name, info) for name, info in RolloutRow.model_fields.items()],
    metadata={b"rollflow.schema_version": str(SCHEMA_VERSION).encode()},
)


def staleness(consuming_step: int, policy_version: int) -> int:
    """Policy steps between the weights that sampled and the weights that train (step is 1-based)."""
    return (consuming_step - 1) - policy_version


def group_id(step: int, group: int) -> str:
    """A group's id: its samples' `group_id`, and the session id (its requests' session header) that keeps
    them on one replica. The same (step, group) gets the same id in every attempt, so a resumed step's groups
    keep theirs."""
    return f"s{step:06d}-g{group:04d}"


def sample_id(group: str, k: int) -> str:
    """The k-th sample of group `group`: the lake's `sample_id` (unique within a run)."""
    return f"{group}-{k:02d}"


def rollouts_root(output_root: str) -> str:
    return join(output_root, "rollouts")


def step_path(output_root: str, step: int) -> str:
    return step_dir(rollouts_root(output_root), step)


def to_table(rows: Sequence[RolloutRow | Mapping[str, Any]]) -> pa.Table:
    """Rows to a table with the rollout schema. Mappings are validated as `RolloutRow` first (a missing
    required column raises a ValueError naming it; a missing optional one becomes null)."""
    typed = [r if isinstance(r, RolloutRow) else RolloutRow.model_validate(r) for r in rows]
    columns = {f.name: [getattr(r, f.name) for r in typed] for f in ROLLOUT_SCHEMA}
    table = pa.Table.from_pydict(columns, schema=ROLLOUT_SCHEMA)
    check_routed_experts(table)
    for r in typed:
        check_episode(r)
        check_images(r)
        for name in ("completion_kept", "teacher_logprobs", "token_advantages"):
            values = getattr(r, name)
            if values is not None and len(values) != len(r.completion_ids):
                n, k = len(r.completion_ids), len(values)
                raise ValueError(f"{r.sample_id}: {name} has {k} entries for {n} completion tokens")
    return table


def check_episode(row: RolloutRow) -> None:
    """A multi-turn row's mask and logprobs align with its completion, and it ends on a model token (the
    trainer finds a sample's length from its last trained token)."""
    mask = row.completion_mask
    if mask is None:
        return
    n = len(row.completion_ids)
    if len(row.completion_logprobs) != n:
        raise ValueError(f"{row.sample_id}: {len(row.completion_logprobs)} logprobs for {n} completion tokens")
    if len(mask) != n or set(mask) - {0, 1} or not mask or mask[-1] != 1:
        raise ValueError(f"{row.sample_id}: completion_mask must be {n} zeros and ones ending with a model token (1)")
    turns = row.turn_policy_versions or []
    if len(turns) != len(row.turn_policy_versions_end or []) or not turns:
        raise ValueError(f"{row.sample_id}: turn_policy_versions and turn_policy_versions_end need one entry per turn")


def image_digests(images: Sequence[bytes]) -> list[str]:
    """The `image_sha256` of a row's images."""
    return [hashlib.sha256(b).hexdigest() for b in images]


def check_images(row: RolloutRow) -> None:
    """A row's images come with one matching checksum each (or neither column)."""
    verified_images(row.images, row.image_sha256, row.sample_id)


def verified_images(images: Sequence[bytes] | None, digests: Sequence[str] | None, where: str) -> list[bytes]:
    """A row's images (`[]` for a text-only row), after checking each against its `image_sha256`: an image
    changed in the shard after the orchestrator wrote it raises a ValueError naming the sample and the image."""
    images, digests = list(images or []), list(digests or [])
    if len(images) != len(digests):
        raise ValueError(f"{where}: {len(images)} images but {len(digests)} image_sha256 entries")
    for i, (data, want) in enumerate(zip(images, image_digests(images), strict=True)):
        if digests[i] != want:
            raise ValueError(f"{where}: image {i} ({len(data)} bytes) does not match its image_sha256")
    return images


def metric_means(table: pa.Table) -> dict[str, float]:
    """The step's mean of each rubric score name (`metric_names`/`metric_values`) over the rows that carry it."""
    if "metric_names" not in table.column_names:
        return {}
    sums: dict[str, list[float]] = {}
    columns = (table.column("metric_names").to_pylist(), table.column("metric_values").to_pylist())
    for names, values in zip(*columns, strict=True):
        for name, value in zip(names or [], values or [], strict=True):
            sums.setdefault(name, []).append(value)
    return {f"env/{name}": sum(v) / len(v) for name, v in sorted(sums.items())}


def mean_teacher_gap(samples: Iterable[tuple[list[float], list[float] | None, list[int] | None]]) -> float | None:
    """The mean of sampler logprob - teacher logprob over the model-sampled tokens of (completion_logprobs,
    teacher_logprobs, completion_mask) triples (a None mask: every token); None without any such token."""
    total, tokens = 0.0, 0
    for sampler, teacher, mask in samples:
        for k, (s, t) in enumerate(zip(sampler, teacher or [], strict=False)):
            if mask is None or mask[k]:
                total, tokens = total + s - t, tokens + 1
    return total / tokens if tokens else None


def teacher_kl(table: pa.Table) -> dict[str, float]:
    """The step's `teacher_kl`: the mean over model-sampled completion tokens of sampler logprob - teacher logprob
    (the reverse KL from the teacher, estimated on the student's own samples); {} without teacher logprobs."""
    if "teacher_logprobs" not in table.column_names or table.column("teacher_logprobs").null_count == table.num_rows:
        return {}
    cols = ("completion_logprobs", "teacher_logprobs", "completion_mask")
    gap = mean_teacher_gap(zip(*(table.column(c).to_pylist() for c in cols), strict=True))
    return {} if gap is None else {"teacher_kl": gap}


def check_routed_experts(table: pa.Table) -> None:
    """A non-null `routed_experts` must be `[seq, layers, top_k]` with seq = prompt + completion - 1 (every
    position the sampler ran through the model) and the same layers and top_k in every row and token."""
    import pyarrow.compute as pc

    col = table.column("routed_experts")
    if col.null_count == len(col):
        return
    valid = pc.is_valid(col)
    seq = pc.filter(pc.list_value_length(col), valid).to_pylist()
    want = pc.filter(
        pc.subtract(
            pc.add(
                pc.list_value_length(table.column("prompt_ids")), pc.list_value_length(table.column("completion_ids"))
            ),
            1,
        ),
        valid,
    ).to_pylist()
    ids = pc.filter(table.column("sample_id"), valid).to_pylist()
    for sid, got, exp in zip(ids, seq, want, strict=True):
        if got != exp:
            raise ValueError(f"routed_experts of {sid}: {got} positions, expected prompt + completion - 1 = {exp}")
    tokens = pc.list_flatten(col)
    layers = set(pc.list_value_length(tokens).to_pylist())
    top_k = set(pc.list_value_length(pc.list_flatten(tokens)).to_pylist())
    if len(layers) > 1 or len(top_k) > 1:
        raise ValueError(
            f"routed_experts must be [seq, layers, top_k] with fixed layers and top_k; got layers {sorted(layers)}, "
            f"top_k {sorted(top_k)}"
        )


def _ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def write_step(fs: fsspec.AbstractFileSystem, output_root: str, step: int, table: pa.Table, meta: dict) -> dict:
    """Commit one step's shard set. `meta` (timings, counts) goes into the manifest."""
    if table.schema != ROLLOUT_SCHEMA:
        table = table.cast(ROLLOUT_SCHEMA)
    files = {"part-00000.arrow": _ipc_bytes(table)}
    info = {"step": step, "rows": table.num_rows, "schema_version": SCHEMA_VERSION, **meta}
    return commit_dir(fs, step_path(output_root, step), files, info)


def read_step(fs: fsspec.AbstractFileSystem, output_root: str, step: int) -> tuple[pa.Table, dict]:
    """Read a committed step, verifying every shard against its manifest."""
    directory = step_path(output_root, step)
    manifest = read_manifest(fs, directory)
    tables = []
    for name in sorted(manifest["files"]):
        with pa.ipc.open_file(pa.BufferReader(read_verified(fs, directory, name, manifest))) as reader:
            tables.append(reader.read_all())
    return pa.concat_tables(tables), manifest


def committed_rollout_steps(fs: fsspec.AbstractFileSystem, output_root: str) -> list[int]:
    return committed_steps(fs, rollouts_root(output_root))
