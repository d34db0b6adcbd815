"""Evaluation results: Arrow shards committed chunk by chunk, like rollouts, plus the settings and the summary.

Layout (under OUTPUT_DIR/evals/):

    <name>/_eval.json                      the settings and target the samples depend on (written first)
    <name>/chunk=NNNNNN/part-00000.arrow   one row per sample (`EvalRow`) of one environment's block of tasks
    <name>/chunk=NNNNNN/_manifest.json     written last: the chunk is committed (storage/fs.py commit protocol)
    <name>/_summary.json                   the metrics over every chunk (written once all are committed)
    online/version=NNNNNN/...              the same, for the evaluations the orchestrator runs during RL

A killed evaluation leaves whole chunks only; a rerun with the same `_eval.json` skips them. Names starting
with `_` stay out of Arrow dataset discovery, so `pyarrow.dataset.dataset("OUTPUT_DIR/evals/<name>",
format="ipc", partitioning="hive")` reads the samples (with `chunk`, and under online/ `version`, as columns);
`read_samples` verifies each shard against its manifest instead.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from config.eval import NAME_PATTERN, ONLINE
from storage.fs import (
    commit_dir,
    committed_steps,
    join,
    read_manifest,
    read_verified,
    remove_committed,
    write_json,
)
from storage.rollouts import Float32, Int32, _arrow_field, _ipc_bytes

SCHEMA_VERSION = 1
SPEC_FILE, SUMMARY_FILE = "_eval.json", "_summary.json"
SHARD = "part-00000.arrow"


class EvalRow(BaseModel):
    """One evaluation sample; the shard schema (`EVAL_SCHEMA`) is derived from it (docs/evaluation.md)."""

    model_config = ConfigDict(extra="forbid")

    env: str
    task_index: Int32
    sample_index: Int32
    policy_version: int
    policy_version_end: int
    prompt_ids: list[Int32]
    completion_ids: list[Int32]
    reward: float
    correct: bool  # reward >= eval.correct_threshold
    temperature: Float32
    seed: int  # the request's seed (engines/seeds.py derive_seed): the samples are reproducible
    finish_reason: str
    prompt_text: str
    completion_text: str
    answer: str  # the environment's reference answer


EVAL_SCHEMA = pa.schema(
    [_arrow_field(name, info) for name, info in EvalRow.model_fields.items()],
    metadata={b"rollflow.eval_schema_version": str(SCHEMA_VERSION).encode()},
)


class EvalStoreError(ValueError):
    """A name that is not one safe folder, or an existing evaluation made with other settings."""


def evals_root(output_root: str) -> str:
    return join(output_root, "evals")


def eval_dir(output_root: str, name: str) -> str:
    """`OUTPUT_DIR/evals/<name>`; `name` is one folder (config/eval.py NAME_PATTERN), never a path."""
    if not NAME_PATTERN.fullmatch(name) or name == ONLINE:
        raise EvalStoreError(f"evaluation name {name!r} is not one folder name (letters, digits, '.', '_', '-')")
    return join(evals_root(output_root), name)


def online_root(output_root: str) -> str:
    return join(evals_root(output_root), ONLINE)


def online_dir(output_root: str, version: int) -> str:
    return join(online_root(output_root), f"version={int(version):06d}")


def to_table(rows: list[EvalRow]) -> pa.Table:
    columns = {f.name: [getattr(r, f.name) for r in rows] for f in EVAL_SCHEMA}
    return pa.Table.from_pydict(columns, schema=EVAL_SCHEMA)


def chunk_dir(directory: str, chunk: int) -> str:
    return join(directory, f"chunk={chunk:06d}")


def write_chunk(fs: fsspec.AbstractFileSystem, directory: str, chunk: int, rows: list[EvalRow], meta: dict) -> dict:
    """Commit one chunk's samples; `meta` (its environment and task range) goes into the manifest."""
    table = to_table(rows)
    info = {"chunk": chunk, "rows": table.num_rows, "schema_version": SCHEMA_VERSION, **meta}
    return commit_dir(fs, chunk_dir(directory, chunk), {SHARD: _ipc_bytes(table)}, info)


def committed_chunks(fs: fsspec.AbstractFileSystem, directory: str) -> list[int]:
    return committed_steps(fs, directory, key="chunk")


def read_samples(fs: fsspec.AbstractFileSystem, directory: str) -> pa.Table:
    """Every committed chunk's rows in chunk order, each shard checked against its manifest (CorruptError)."""
    tables = [EVAL_SCHEMA.empty_table()]
    for chunk in committed_chunks(fs, directory):
        path = chunk_dir(directory, chunk)
        manifest = read_manifest(fs, path)
        with pa.ipc.open_file(pa.BufferReader(read_verified(fs, path, SHARD, manifest))) as reader:
            tables.append(reader.read_all())
    return pa.concat_tables(tables)


def _read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def read_spec(fs: fsspec.AbstractFileSystem, directory: str) -> dict | None:
    return _read_json(fs, join(directory, SPEC_FILE))


def read_summary(fs: fsspec.AbstractFileSystem, directory: str) -> dict | None:
    return _read_json(fs, join(directory, SUMMARY_FILE))


def write_summary(fs: fsspec.AbstractFileSystem, directory: str, summary: dict) -> None:
    write_json(fs, join(directory, SUMMARY_FILE), summary)


def claim(fs: fsspec.AbstractFileSystem, directory: str, spec: dict, overwrite: bool = False) -> str:
    """Start or continue the evaluation in `directory`: 'new', 'resumed' (same spec, chunks kept) or 'done'
    (its summary exists). Another spec there is refused unless `overwrite`, which removes those results first."""
    old = read_spec(fs, directory)
    if old is not None and old != spec and not overwrite:
        changed = sorted(k for k in set(old) | set(spec) if old.get(k) != spec.get(k))
        raise EvalStoreError(
            f"{directory} holds an evaluation with other settings ({', '.join(changed)} differ); "
            "choose another eval.name, or pass --overwrite to replace it"
        )
    if old is not None and old != spec:
        remove(fs, directory)
        old = None
    if old is None:
        write_json(fs, join(directory, SPEC_FILE), spec)
        return "new"
    return "done" if read_summary(fs, directory) is not None else "resumed"


def remove(fs: fsspec.AbstractFileSystem, directory: str) -> None:
    """Remove an evaluation: its summary, then its chunks (manifest first), then the folder."""
    summary = join(directory, SUMMARY_FILE)
    if fs.exists(summary):
        fs.rm(summary)
    for chunk in committed_chunks(fs, directory):
        remove_committed(fs, chunk_dir(directory, chunk))
    if fs.exists(directory):
        fs.rm(directory, recursive=True)
    fs.invalidate_cache(directory)


def list_evals(fs: fsspec.AbstractFileSystem, output_root: str) -> dict[str, dict | None]:
    """Each evaluation under evals/ (`<name>` and `online/version=NNNNNN`) -> its summary (None: unfinished)."""
    out: dict[str, dict | None] = {}
    root = evals_root(output_root)
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return out
    for entry in sorted(fs.ls(root, detail=False)):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name == ONLINE:
            for version in online_versions(fs, output_root, finished=False):
                out[f"{ONLINE}/version={version:06d}"] = read_summary(fs, online_dir(output_root, version))
        elif NAME_PATTERN.fullmatch(name) and fs.isdir(entry):
            out[name] = read_summary(fs, join(root, name))
    return out


def online_versions(fs: fsspec.AbstractFileSystem, output_root: str, finished: bool = True) -> list[int]:
    """Versions with an online evaluation folder under evals/online/; `finished`: only those with a summary."""
    root = online_root(output_root)
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    versions = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("version=") and name[8:].isdigit():
            v = int(name[8:])
            if not finished or read_summary(fs, online_dir(output_root, v)) is not None:
                versions.append(v)
    return sorted(versions)


def table_rows(summary: dict) -> tuple[list[str], list[list[Any]]]:
    """A summary as a table: one row per environment and an `all` row (the mean over environments)."""
    ks = summary["spec"]["k"]
    header = ["env", "tasks", "samples", "reward", "reward 95% CI", *(f"pass@{k}" for k in ks)]
    rows: list[list[Any]] = []
    for env, m in summary["envs"].items():
        ci = m["reward_ci95"]
        rows.append(
            [env, m["tasks"], m["samples"], m["reward_mean"], "-" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"]
            + [m[f"pass@{k}"] for k in ks]
        )
    rows.append(["all", "", summary["samples"], summary["reward_mean"], ""] + ["" for _ in ks])
    return header, rows
