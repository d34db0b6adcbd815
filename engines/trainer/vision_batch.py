"""Images in the trainer's batches: each rollout row's images read from the lake, checked, and turned into the
vision encoder's inputs once per step.

    rollout table `images` (list<binary>, null for text rows) + `image_sha256` (list<string>)
      -> `row_images`: per row its image bytes, or the reason the row is dropped: a digest that does not match
         its bytes, an image that does not decode within vision.py's bounds, prompt image tokens that do not
         match its images (vision.check_prompt), or an image token in the completion (a sampled <|image_pad|>
         has no image behind it)
      -> `make_batch` (engines/trainer/batch.py): per row `VisionInputs` (vision.pixel_inputs, as the sampler
         computed them from the same bytes), its image count, and for a dropped row: image tokens blanked to
         the pad token, loss mask zeroed (the row trains nothing and is left out of mismatch_kl), counted
      -> `Batch.vision()`: the micro-batch's images in row order, which the model's forward scatters into the
         image tokens in the same order.

A dropped row never stops the step: `images_dropped` in the step's metrics counts them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa
import torch

from engines.models import vision
from engines.models.vision import ImageError, VisionInputs, VisionSpec
from storage.rollouts import verified_images

log = logging.getLogger("rollflow.trainer")

IMAGES, DIGESTS = "images", "image_sha256"


@dataclass
class RowImages:
    images: tuple[bytes, ...]  # () for a text row and for a dropped one
    dropped: str | None = None  # why the row cannot be trained on, None when it can


def _check(prompt: list[int], completion: list[int], images: list[bytes], digests, spec: VisionSpec) -> None:
    """Raise ImageError unless the row's images are the ones its digests name and its tokens describe."""
    if digests is not None:
        try:
            verified_images(images, digests, "row")
        except ValueError as exc:
            raise ImageError(str(exc)) from None
    sizes = [vision.image_size(data, f"image {i}") for i, data in enumerate(images)]
    vision.check_prompt(prompt, sizes, spec)
    if spec.image_token_id in completion:
        raise ImageError("the completion holds an image token, which no image stands behind")


def row_images(table: pa.Table, spec: VisionSpec) -> list[RowImages]:
    """Every row's checked images (see the module docstring); a table without an `images` column is text only
    (its rows are still checked for stray image tokens)."""
    n = table.num_rows
    images = table.column(IMAGES).to_pylist() if IMAGES in table.column_names else [None] * n
    digests = table.column(DIGESTS).to_pylist() if DIGESTS in table.column_names else [None] * n
    prompts, completions = table.column("prompt_ids").to_pylist(), table.column("completion_ids").to_pylist()
    out = []
    for i in range(n):
        row = list(images[i] or [])
        try:
            _check(prompts[i], completions[i], row, digests[i], spec)
        except ImageError as exc:
            out.append(RowImages((), str(exc)))
            continue
        out.append(RowImages(tuple(row)))
    dropped = [(i, r.dropped) for i, r in enumerate(out) if r.dropped]
    if dropped:
        log.warning(
            f"{len(dropped)} of {n} rows dropped for their images; the first: row {dropped[0][0]}: {dropped[0][1]}"
        )
    return out


def pixels_of(rows: list[RowImages], spec: VisionSpec) -> list[VisionInputs | None]:
    """The encoder inputs of each row's images (None for a row without any)."""
    return [vision.pixel_inputs(r.images, spec) for r in rows]


def blank(ids: torch.Tensor, spec: VisionSpec, pad_id: int) -> torch.Tensor:
    """A dropped row's ids with its image tokens replaced by the pad token (nothing to scatter images into)."""
    return ids.masked_fill(ids == spec.image_token_id, pad_id)


def concat(parts: list[VisionInputs | None]) -> VisionInputs | None:
    """The images of several rows, in row order, as one encoder input; None when no row has one."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return VisionInputs(
        torch.cat([p.pixel_values for p in present]), torch.cat([p.grid_thw for p in present]).to(torch.long)
    )
