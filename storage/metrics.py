"""`OUTPUT_DIR/metrics.jsonl`: one JSON object per trainer step, keyed by step.

The file is rewritten whole (atomically) on each record, so a step appears at most once even when a
step is recorded again, and it works on object stores, which cannot append.
"""

from __future__ import annotations

import json

import fsspec

from storage.fs import join, write_bytes_atomic


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
    rows = MetricsLog(fs, output_root).rows
    return [rows[s] for s in sorted(rows)]


def mlflow_name(key: str) -> str:
    """A metrics.jsonl key as an MLflow metric name: MLflow refuses '@' (pass@k is logged as pass_at_k)."""
    return key.replace("@", "_at_")
