"""`OUTPUT_DIR/metrics.jsonl`: one JSON object per trainer step, keyed by step.

The file is rewritten whole (atomically) on each record, so a step appears at most once even when a
step is recorded again, and it works on object stores, which cannot append.

Rows may carry held-out evaluation keys (`eval/reward_mean`, `eval/<env>/reward_mean`, `eval/<env>/pass@<k>`)
merged into the row of the step whose policy version was evaluated; a row `step = 0` may carry only those
(version 0). Readers take a curve as the rows where its key holds a finite number (`metric_curve`), so rows
without `reward_mean` drop out of the reward curve. `MetricsFollower` re-reads the file only when it changed,
for a watcher in another process than the writer.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import fsspec

from storage.fs import join, write_bytes_atomic

# A `rollflow sft` run's data report beside its metrics: rows read, samples, rows skipped by reason, tokens.
SFT_DATA_FILE = "sft_data.json"
EVAL_PREFIX = "eval/"
_EVAL_CURVE = re.compile(r"eval/(?:[^/]+/)?(?:reward_mean|pass@\d+)")


class MetricsLog:
    def __init__(self, fs: fsspec.AbstractFileSystem, output_root: str):
        self.fs, self.path = fs, join(output_root, "metrics.jsonl")
        self.rows: dict[int, dict] = {}
        if fs.exists(self.path):
            for line in fs.cat_file(self.path).decode().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.rows[int(row["step"])] = row

    def record(self, row: dict) -> None:
        self.rows[int(row["step"])] = row
        self._write()

    def truncate_after(self, step: int) -> None:
        """Drop rows after `step`: a resumed run records those steps again."""
        self.rows = {s: r for s, r in self.rows.items() if s <= step}
        self._write()

    def _write(self) -> None:
        text = "".join(json.dumps(self.rows[s]) + "\n" for s in sorted(self.rows))
        write_bytes_atomic(self.fs, self.path, text.encode())


def read_metrics(fs: fsspec.AbstractFileSystem, output_root: str) -> list[dict]:
    fs.invalidate_cache(join(output_root, "metrics.jsonl"))  # another process rewrites it; listings are cached
    rows = MetricsLog(fs, output_root).rows
    return [rows[s] for s in sorted(rows)]


class MetricsFollower:
    """Reads metrics.jsonl again only when its size or modification stamp changed since the last read."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_root: str):
        self.fs, self.root = fs, output_root
        self.path = join(output_root, "metrics.jsonl")
        self._stamp: tuple | None = None

    def poll(self) -> list[dict] | None:
        """The rows, or None when the file is unchanged (a missing file reads as no rows)."""
        self.fs.invalidate_cache(self.path)
        try:
            info = self.fs.info(self.path)
        except FileNotFoundError:
            info = {}
        stamp = (info.get("size"), info.get("mtime") or info.get("ETag") or info.get("LastModified"))
        if stamp == self._stamp:
            return None
        rows = read_metrics(self.fs, self.root)
        self._stamp = stamp
        return rows


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def metric_curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for each row where `key` holds a finite number, in step order."""
    return sorted((int(r["step"]), float(r[key])) for r in rows if is_number(r.get(key)))


def eval_curve_keys(rows: list[dict]) -> list[str]:
    """The held-out evaluation keys present: `eval/reward_mean` first, then per environment, sorted."""
    keys = {k for r in rows for k, v in r.items() if _EVAL_CURVE.fullmatch(k) and is_number(v)}
    return sorted(keys, key=lambda k: (k != f"{EVAL_PREFIX}reward_mean", k))


def mlflow_name(key: str) -> str:
    """A metrics.jsonl key as an MLflow metric name: MLflow refuses '@' (pass@k is logged as pass_at_k)."""
    return key.replace("@", "_at_")
