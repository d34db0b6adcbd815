"""Rollout shards: Arrow IPC files hive-partitioned by step, committed by a manifest written last.

Layout: `OUTPUT_DIR/rollouts/step=NNNNNN/part-00000.arrow` + `_manifest.json`. Any Arrow reader can
open the folder (`pyarrow.dataset.dataset(path, format="ipc", partitioning="hive")`); rollflow's own
reader goes through the manifest and verifies checksums. Columns are documented in docs/rollouts.md.
"""

from __future__ import annotations

import io

import fsspec
import pyarrow as pa

from storage.fs import commit_dir, committed_steps, join, read_manifest, read_verified, step_dir

SCHEMA_VERSION = 1

# Field order is the documented order; `step` is also the hive partition key.
ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),  # int32: what hive discovery infers from step=N
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("policy_version_end", pa.int64(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("completion_text", pa.string(), nullable=False),
        # [seq, layers, top_k] expert ids per token for MoE router replay; null for dense models.
        pa.field("routed_experts", pa.list_(pa.list_(pa.list_(pa.int16()))), nullable=True),
    ],
    metadata={b"rollflow.schema_version": str(SCHEMA_VERSION).encode()},
)


def staleness(consuming_step: int, policy_version: int) -> int:
    """Policy steps between the weights that sampled and the weights that train (step is 1-based)."""
    return (consuming_step - 1) - policy_version


def rollouts_root(output_root: str) -> str:
    return join(output_root, "rollouts")


def step_path(output_root: str, step: int) -> str:
    return step_dir(rollouts_root(output_root), step)


def to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by column name) to a table with the rollout schema; missing optional -> null."""
    columns = {f.name: [r.get(f.name) for r in rows] for f in ROLLOUT_SCHEMA}
    table = pa.Table.from_pydict(columns, schema=ROLLOUT_SCHEMA)
    # Arrow does not enforce `nullable=False`; a missing required value would be written as a null.
    missing = [f.name for f in ROLLOUT_SCHEMA if not f.nullable and table.column(f.name).null_count]
    if missing:
        raise ValueError(f"rollout rows lack required column(s): {', '.join(missing)}")
    check_routed_experts(table)
    return table


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
