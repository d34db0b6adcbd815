"""`OUTPUT_DIR/metrics.jsonl`: one JSON object per trainer step, keyed by step.

A step appears at most once. The writer (`MetricsLog`, the trainer's) keeps only the last step it recorded, so
its memory stays flat over a run of any length: a step after every step in the file is appended on a local disk
(fsync'd; O(1) per step) and, on an object store, which cannot append, written as the whole file again (its
bytes held by the writer: ~1 KB a step). A step recorded again, a merge into an earlier step (evaluation values)
and a rollback (`truncate_after`) read the file and write it again whole and atomically. Readers take complete
lines only: an append cut short by a crash leaves a last line without its newline, which is no row (the writer
drops it at its next write).

Rows may carry held-out evaluation keys (`eval/reward_mean`, `eval/<env>/reward_mean`, `eval/<env>/pass@<k>`)
merged into the row of the step whose policy version was evaluated; a row `step = 0` may carry only those
(version 0). Readers take a curve as the rows where its key holds a finite number (`metric_curve`), so rows
without `reward_mean` drop out of the reward curve. `MetricsFollower` (a watcher in another process than the
writer) reads only what was appended since its last read, and keeps only the curve keys of each row.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import fsspec

from storage.fs import append_durable, is_local, join, write_bytes_atomic

# A `rollflow sft` run's data report beside its metrics: rows read, samples, rows skipped by reason, tokens.
SFT_DATA_FILE = "sft_data.json"
EVAL_PREFIX = "eval/"
_EVAL_CURVE = re.compile(r"eval/(?:[^/]+/)?(?:reward_mean|pass@\d+)")


def parse_rows(data: bytes) -> dict[int, dict]:
    """Rows by step of metrics.jsonl's bytes; a last line without its newline (an append cut short) is no row."""
    rows: dict[int, dict] = {}
    for line in data.split(b"\n")[:-1]:
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return rows


def _encode(rows: dict[int, dict]) -> bytes:
    return "".join(json.dumps(rows[s]) + "\n" for s in sorted(rows)).encode()


class MetricsLog:
    """The writer of one run's metrics.jsonl (the module docstring says how each record is written)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_root: str):
        self.fs, self.path = fs, join(output_root, "metrics.jsonl")
        data = self._read()
        self.last_step = max(parse_rows(data), default=None)
        self._appendable = data.endswith(b"\n")  # the file exists and ends where a line does
        self._held = None if is_local(fs) else data  # an object store's file, to write it again with a new row

    def _read(self) -> bytes:
        self.fs.invalidate_cache(self.path)  # another process may have rewritten it; listings are cached
        return self.fs.cat_file(self.path) if self.fs.exists(self.path) else b""

    def rows(self) -> dict[int, dict]:
        """Every row by step, read from the file."""
        return parse_rows(self._read() if self._held is None else self._held)

    def row(self, step: int) -> dict | None:
        return self.rows().get(step)

    def record(self, row: dict) -> None:
        step, line = int(row["step"]), (json.dumps(row) + "\n").encode()
        if self.last_step is not None and step <= self.last_step or not self._appendable:
            self._rewrite({**self.rows(), step: row})
        elif self._held is not None:
            self._held += line
            write_bytes_atomic(self.fs, self.path, self._held)
        else:
            append_durable(self.fs, self.path, line)
        self.last_step = max(step, self.last_step if self.last_step is not None else step)

    def truncate_after(self, step: int) -> None:
        """Drop rows after `step`: a resumed run records those steps again."""
        self._rewrite({s: r for s, r in self.rows().items() if s <= step})

    def _rewrite(self, rows: dict[int, dict]) -> None:
        data = _encode(rows)
        write_bytes_atomic(self.fs, self.path, data)
        self.last_step, self._appendable = max(rows, default=None), True
        self._held = None if self._held is None else data


def read_metrics(fs: fsspec.AbstractFileSystem, output_root: str) -> list[dict]:
    rows = MetricsLog(fs, output_root).rows()
    return [rows[s] for s in sorted(rows)]


def is_curve_key(key: str) -> bool:
    """The keys a live view of a run draws: the reward and the held-out evaluation curves."""
    return key == "reward_mean" or _EVAL_CURVE.fullmatch(key) is not None


class MetricsFollower:
    """Follows metrics.jsonl from another process than its writer. Each poll reads only the bytes past what it read
    before, after checking that the last line it read still ends there; a file that was rewritten (a rollback,
    a merge into an earlier step) fails that check and is read again from the start. Of each row it keeps the
    step and the keys `keep` accepts, so a long run costs it a little memory per step and each poll little work."""

    def __init__(self, fs: fsspec.AbstractFileSystem, output_root: str, keep: Callable[[str], bool] = is_curve_key):
        self.fs, self.root, self.keep = fs, output_root, keep
        self.path = join(output_root, "metrics.jsonl")
        self._stamp: tuple | None = None
        self._offset, self._last_line = 0, b""  # bytes read so far; the last complete line among them
        self._rows: dict[int, dict] = {}
        self.skipped = 0  # lines that were not a row (clobbered by another writer): left out of the view

    def poll(self) -> list[dict] | None:
        """The rows (their kept keys), or None when the file is unchanged (a missing file reads as no rows)."""
        self.fs.invalidate_cache(self.path)
        try:
            info = self.fs.info(self.path)
        except FileNotFoundError:
            info = {}
        stamp = (info.get("size"), info.get("mtime") or info.get("ETag") or info.get("LastModified"))
        if stamp == self._stamp:
            return None
        self._take(self._new_bytes(int(info.get("size") or 0)))
        self._stamp = stamp
        return [self._rows[s] for s in sorted(self._rows)]

    def _new_bytes(self, size: int) -> bytes:
        if 0 < self._offset <= size:
            start = self._offset - len(self._last_line)
            data = self.fs.cat_file(self.path, start=start, end=size)
            if data.startswith(self._last_line):
                return data[len(self._last_line) :]
        self._offset, self._last_line, self._rows, self.skipped = 0, b"", {}, 0  # rewritten or new: from the start
        return self.fs.cat_file(self.path) if size else b""

    def _take(self, data: bytes) -> None:
        complete = data[: data.rfind(b"\n") + 1]  # a line still being appended waits for the next poll
        for line in complete.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self._rows[int(row["step"])] = {k: v for k, v in row.items() if k == "step" or self.keep(k)}
            except (ValueError, TypeError, KeyError, AttributeError):
                self.skipped += 1
        if complete:
            self._offset += len(complete)
            self._last_line = complete[complete.rstrip(b"\n").rfind(b"\n") + 1 :]


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
    """A metrics.jsonl key as an MLflow metric name: MLflow refuses "@" (pass@k is logged as pass_at_k) and "="
    (mismatch_kl/images=K is logged as mismatch_kl/images_K)."""
    return key.replace("@", "_at_").replace("=", "_")
