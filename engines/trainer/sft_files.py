"""Read the conversations of a `[sft.data] path` (a file, a glob or a directory; local or a URL, through
fsspec with the run's storage settings) row by row, whatever the format.

Data flow: `dataset_files` resolves the path into (file, format) pairs in a fixed order, then `read_rows`
yields each row's `messages` value with its 1-based row number. JSON Lines are parsed line by line (a line
that is not JSON is a bad row); Parquet and Arrow IPC files (file or stream format) are read column-wise;
a Hugging Face `save_to_disk` directory is read through its `state.json` list of Arrow stream files.
Nothing here judges a conversation: engines/trainer/sft_data.py does, naming the file and row.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import Any

from storage.fs import join

MISSING = object()  # a row without the messages column
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".ipc": "arrow"}
HF_INFO = "dataset_info.json"
HF_STATE = "state.json"


class DataError(ValueError):
    """The dataset cannot be used as configured; the message names the file (and row) and what is valid."""


class BadRow(ValueError):
    """One row the trainer cannot use; `reason` is the count it is skipped under with on_bad_row = 'skip'."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def display(fs: Any, path: str) -> str:
    """A file's name as the user wrote it: with the URL scheme on object stores."""
    return path if "file" in _protocols(fs) else fs.unstrip_protocol(path)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def dataset_files(fs: Any, path: str, fmt: str) -> list[tuple[str, str]]:
    """(file, format) of every file the path names, sorted; refuses a path that names none."""
    if any(c in path for c in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        if fs.exists(join(path, "dataset_dict.json")):
            splits = json.loads(fs.cat_file(join(path, "dataset_dict.json"))).get("splits", [])
            raise DataError(
                f"{display(fs, path)} is a Hugging Face DatasetDict (splits {splits}): point [sft.data] path at "
                f"one split's directory, e.g. {display(fs, join(path, str(splits[0]) if splits else 'train'))}"
            )
        if fmt in ("auto", "hf") and fs.exists(join(path, HF_INFO)):
            return [(join(path, f), "hf-stream") for f in _hf_data_files(fs, path)]
        files = sorted(f for f in fs.find(path) if fmt != "auto" or _format_of(f) is not None)
    elif fs.isfile(path):
        files = [path]
    else:
        raise DataError(f"[sft.data] path = {display(fs, path)!r}: no such file or directory")
    typed = [(f, fmt if fmt != "auto" else _format_of(f)) for f in files]
    unknown = [f for f, t in typed if t is None]
    if unknown:
        raise DataError(
            f"{display(fs, unknown[0])}: unknown extension; name files .jsonl, .json, .parquet, .arrow or .ipc, or "
            "set [sft.data] format"
        )
    if not typed:
        raise DataError(f"[sft.data] path = {display(fs, path)!r} names no data files (.jsonl, .parquet, .arrow)")
    return [(f, str(t)) for f, t in typed]


def _format_of(path: str) -> str | None:
    return EXTENSIONS.get(posixpath.splitext(path)[1].lower())


def _hf_data_files(fs: Any, directory: str) -> list[str]:
    """The Arrow files a `save_to_disk` directory lists in state.json, each checked to stay inside it."""
    state = json.loads(fs.cat_file(join(directory, HF_STATE)))
    names = [entry["filename"] for entry in state.get("_data_files", [])]
    for name in names:
        if posixpath.isabs(name) or ".." in name.split("/"):
            raise DataError(f"{display(fs, join(directory, HF_STATE))}: data file {name!r} is outside the directory")
    if not names:
        raise DataError(f"{display(fs, join(directory, HF_STATE))} lists no data files")
    return names


def read_rows(fs: Any, path: str, fmt: str, column: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, the row's `column` value, MISSING if the row has none); a JSON line that does not
    parse is yielded as a BadRow instance."""
    if fmt == "jsonl":
        yield from _jsonl_rows(fs.cat_file(path), column)
        return
    table = _read_table(fs, path, fmt)
    if column not in table.column_names:
        for i in range(table.num_rows):
            yield i + 1, MISSING
        return
    for i, value in enumerate(table.column(column).to_pylist()):
        yield i + 1, value


def _jsonl_rows(data: bytes, column: str) -> Iterator[tuple[int, Any]]:
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield n, BadRow("not_json", f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        yield n, row.get(column, MISSING) if isinstance(row, dict) else MISSING


def _read_table(fs: Any, path: str, fmt: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = fs.cat_file(path)
    try:
        if fmt == "parquet":
            return pq.read_table(pa.BufferReader(data))
        if fmt == "arrow":
            try:
                return pa.ipc.open_file(pa.BufferReader(data)).read_all()
            except pa.ArrowInvalid:  # the stream format (what `datasets` writes)
                return pa.ipc.open_stream(pa.BufferReader(data)).read_all()
        return pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    except pa.ArrowException as exc:
        raise DataError(f"{display(fs, path)}: not a readable {fmt} file: {exc}") from None
