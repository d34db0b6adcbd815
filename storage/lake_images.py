"""The images of a rollout lake as `rollflow lake` reports them (storage/lake.py): how many samples carry how
many images of which sizes, and the contact sheet `--plot` draws, which the trainer also logs to MLflow for a
few samples per step (engines/trainer/tracking.py).

    shard rows (images: list<binary>, image_sha256) -> ImageStats.add (counts; sizes from the PNG/JPEG header)
    selected rows -> contact_sheet: one cell per sample, its images as thumbnails above its id, reward and
                     completion text -> one PNG (PIL only, no matplotlib)

Only PIL reads the images, lazily (the header gives the size); an unreadable image is counted as such, never
fatal: the report is how a damaged lake is inspected.
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

THUMB = 64  # pixels of a thumbnail's longer side
MIN_CELL = 112  # pixels of a cell's width: room for a sample id in the default font
CELL_TEXT_LINES = 3
LINE_PX = 12
MAX_TEXT_CHARS = 22  # of the completion shown under a sample


def size_label(data: bytes) -> str:
    """`WxH` of an image from its header, `unreadable` when PIL cannot open it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return f"{img.width}x{img.height}"
    except Exception:  # PIL raises many types for broken data
        return "unreadable"


class ImageStats:
    """Per lake: samples by image count and images by size."""

    def __init__(self) -> None:
        self.per_sample: Counter[int] = Counter()
        self.sizes: Counter[str] = Counter()

    def add(self, table: Any) -> None:
        if "images" not in table.column_names:  # a shard older than schema version 5: text only
            self.per_sample[0] += table.num_rows
            return
        for images in table.column("images").to_pylist():
            self.per_sample[len(images or [])] += 1
            self.sizes.update(size_label(b) for b in images or [])

    def report(self) -> dict[str, Any]:
        return {
            "samples_with_images": sum(n for k, n in self.per_sample.items() if k),
            "images": sum(k * n for k, n in self.per_sample.items()),
            "per_sample": dict(sorted(self.per_sample.items())),
            "sizes": dict(sorted(self.sizes.items())),
        }


def render_stats(stats: dict[str, Any]) -> str:
    per = ", ".join(f"{k}: {n}" for k, n in stats["per_sample"].items())
    sizes = ", ".join(f"{s} ({n})" for s, n in stats["sizes"].items())
    return (
        f"images: {stats['images']} in {stats['samples_with_images']} samples; "
        f"samples by image count {{{per}}}; sizes: {sizes or '-'}"
    )


def jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """A lake row for JSON: its images as base64 text."""
    if row.get("images"):
        row = {**row, "images": [base64.b64encode(b).decode() for b in row["images"]]}
    return row


def _thumbs(images: Sequence[bytes]) -> list[Any]:
    from PIL import Image

    out = []
    for data in images:
        try:
            with Image.open(io.BytesIO(data)) as img:
                thumb = img.convert("RGB")
                thumb.thumbnail((THUMB, THUMB))
        except Exception:  # an unreadable image shows as a grey square
            thumb = Image.new("RGB", (THUMB, THUMB), (128, 128, 128))
        out.append(thumb)
    return out


def contact_sheet(samples: Iterable[dict[str, Any]], columns: int = 4) -> Any | None:
    """One PIL image of `samples` (rows with `images`, `sample_id`, `reward`, `completion_text`): a cell each,
    `columns` to a row, images side by side above three lines of text. None without samples."""
    from PIL import Image, ImageDraw

    cells = [(s, _thumbs(s.get("images") or [])) for s in samples]
    if not cells:
        return None
    width = max(MIN_CELL, *(sum(t.width + 2 for t in thumbs) for _, thumbs in cells)) + 8
    height = THUMB + CELL_TEXT_LINES * LINE_PX + 10
    rows = (len(cells) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * width, rows * height), (255, 255, 255))
    pen = ImageDraw.Draw(sheet)
    for i, (sample, thumbs) in enumerate(cells):
        x, y = (i % columns) * width + 4, (i // columns) * height + 4
        for thumb in thumbs:
            sheet.paste(thumb, (x, y))
            x += thumb.width + 2
        x = (i % columns) * width + 4
        text = str(sample.get("completion_text", ""))[:MAX_TEXT_CHARS].replace("\n", " ")
        lines = [str(sample.get("sample_id", "")), f"reward {float(sample.get('reward', 0.0)):.2f}", repr(text)]
        for k, line in enumerate(lines):
            pen.text((x, y + THUMB + 2 + k * LINE_PX), line, fill=(0, 0, 0))
    return sheet


def png_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def with_images(table: Any, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` rows of an Arrow table that carry images (the columns the sheet shows), the first sample of
    each group first: a group's samples share their prompt's images, so the sheet shows `limit` prompts when the
    table has them, then more samples of the same groups."""
    if "images" not in table.column_names or limit <= 0:
        return []
    columns = [c for c in ("sample_id", "group_id", "reward", "completion_text", "images") if c in table.column_names]
    rows = [r for r in table.select(columns).to_pylist() if r["images"]]
    firsts: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for r in rows:
        (others if r.get("group_id") in seen else firsts).append(r)
        seen.add(r.get("group_id"))
    return (firsts + others)[:limit]
