"""The prefill's inputs: the left-padded batch of a running batch's new prompts, its attention mask, the distinct
prompts (ids, and for a vision-language model its images' digests) and their images' vision encoder inputs.
Used by generate.py's `Decoder`."""

from __future__ import annotations

from typing import Any

import torch

from engines.models.vision import VisionInputs, digest, pixel_inputs
from engines.models.vlm import is_vision


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p) :] = True
    return ids, valid


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    # Each query also sees itself so pad rows never softmax over an empty set (which would give NaN).
    return (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)


def unique_prompts(
    prompts: list[list[int]], images: list[tuple[bytes, ...]] | None = None, slots: list[int] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order, and each row's index among them. With `images` (per row), a prompt is
    its ids and its images' digests: equal ids with other images are another prompt (another prefill). With
    `slots` (per row, a shared server's adapter slots) equal ids of another tenant are another prompt too."""
    index: dict[tuple, int] = {}
    firsts: list[list[int]] = []
    rows = []
    for i, p in enumerate(prompts):
        key = (tuple(p), tuple(map(digest, images[i])) if images else (), slots[i] if slots else 0)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(p)
        rows.append(index[key])
    return [list(p) for p in firsts], rows


def vision_inputs(model: Any, images: list[tuple[bytes, ...]] | None, row_of: list[int]) -> VisionInputs | None:
    """The encoder inputs of the distinct prompts' images, prompt after prompt (None: a text model, or no images)."""
    if not images or not is_vision(model):
        return None
    first = {u: i for i, u in reversed(list(enumerate(row_of)))}  # each distinct prompt's first row
    ordered = [b for u in range(len(first)) for b in images[first[u]]]
    return pixel_inputs(ordered, model.vision_spec, next(model.parameters()).dtype)
