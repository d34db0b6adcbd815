"""Images in prompts: bounded decoding of image bytes, a vision-language model's image token layout, and the
pixel tensors its vision encoder takes. Shared by the orchestrator, the inference server and the trainer.

    environment Task.images (PNG or JPEG bytes)
      -> orchestrator: the chat template writes <vision_start><image_pad><vision_end> per image, `expand`
         widens each image_pad to the image's token count (`VisionSpec.tokens`, from its size alone)
      -> /v1/completions: the expanded ids + the images (base64); the server `decode`s them, `check_prompt`
         refuses a prompt whose image tokens do not match its images, `pixel_inputs` feeds the prefill
      -> the lake keeps the bytes beside the ids (storage/rollouts.py `images`)
      -> the trainer recomputes `pixel_inputs` from the bytes, so sampler and trainer see the same tensors.

The layout is Qwen2-VL's and its successors' (Qwen2.5-VL, Qwen3-VL): an image of H x W pixels is resized to
multiples of patch_size * merge_size, cut into patch_size patches, and every merge_size x merge_size patches
become one token. `VisionSpec.from_directory` reads it from config.json and preprocessor_config.json.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Images per prompt and the encoded size of one image: the wire's bounds (engines/protocol.py), checked the same
# by the orchestrator, the server and the trainer
from engines.protocol import MAX_IMAGE_BYTES as MAX_IMAGE_BYTES
from engines.protocol import MAX_IMAGES as MAX_IMAGES

if TYPE_CHECKING:
    import torch
    from PIL import Image

# Bounds on what a request or an environment may carry (docs/models.md "Images"): far above the toy tasks'
# 64 x 64 PNGs, low enough that one request cannot exhaust the server.
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded size of one image: PIL's decompression-bomb guard, made strict
IMAGE_FORMATS = ("PNG", "JPEG")


class ImageError(ValueError):
    """An image that cannot be used: the message says which bound or format it broke."""


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 32 * 32
    max_pixels: int = 256 * 256
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_directory(cls, directory: str | Path) -> VisionSpec:
        """From a Hugging Face VLM directory: token ids from config.json, sizes from preprocessor_config.json."""
        directory = Path(directory)
        hf = json.loads((directory / "config.json").read_text())
        pre_path = directory / "preprocessor_config.json"
        pre = json.loads(pre_path.read_text()) if pre_path.exists() else {}
        size = pre.get("size") or {}
        vision = hf.get("vision_config") or {}
        return cls(
            image_token_id=int(hf["image_token_id"]),
            vision_start_id=int(hf["vision_start_token_id"]),
            vision_end_id=int(hf["vision_end_token_id"]),
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 16))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            min_pixels=int(size.get("shortest_edge", pre.get("min_pixels", cls.min_pixels))),
            max_pixels=int(size.get("longest_edge", pre.get("max_pixels", cls.max_pixels))),
            image_mean=tuple(pre.get("image_mean", cls.image_mean)),
            image_std=tuple(pre.get("image_std", cls.image_std)),
        )

    def preprocessor_config(self) -> dict[str, Any]:
        """preprocessor_config.json for a directory this spec describes (transformers' and vLLM's loaders)."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
        }

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the processor resizes an image to: Qwen2-VL's `smart_resize`."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def tokens(self, width: int, height: int) -> int:
        """How many image tokens an image of this size becomes."""
        h, w = self.resized(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes, where: str = "image") -> Image.Image:
    """The RGB image of PNG or JPEG bytes, or ImageError naming `where` and the bound it broke."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in IMAGE_FORMATS:
                raise ImageError(f"{where}: format {img.format}, expected one of {', '.join(IMAGE_FORMATS)}")
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ImageError(f"{where}: {img.width}x{img.height} pixels, over the limit of {MAX_IMAGE_PIXELS}")
            return img.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # PIL raises many types for broken data
        raise ImageError(f"{where}: not a readable image ({type(exc).__name__}: {exc})") from exc


def image_size(data: bytes, where: str = "image") -> tuple[int, int]:
    """(width, height) of an image, checked as `decode` checks it."""
    img = decode(data, where)
    return img.width, img.height


def expand(ids: Sequence[int], sizes: Sequence[tuple[int, int]], spec: VisionSpec) -> list[int]:
    """Widen the i-th single image token of a rendered prompt to image i's token count."""
    out: list[int] = []
    images = iter(sizes)
    for t in ids:
        if t != spec.image_token_id:
            out.append(t)
            continue
        size = next(images, None)
        if size is None:
            raise ImageError(f"the prompt has more image placeholders than its {len(sizes)} image(s)")
        out.extend([spec.image_token_id] * spec.tokens(*size))
    if next(images, None) is not None:
        raise ImageError(f"the prompt has fewer image placeholders than its {len(sizes)} image(s)")
    return out


def image_runs(ids: Sequence[int], spec: VisionSpec) -> list[tuple[int, int]]:
    """(start, length) of each run of image tokens in `ids`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*ids, -1]):
        if t == spec.image_token_id and start is None:
            start = i
        elif t != spec.image_token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def check_prompt(ids: Sequence[int], sizes: Sequence[tuple[int, int]], spec: VisionSpec) -> None:
    """Refuse (ImageError) a prompt whose image token runs are not exactly one per image, of its count."""
    if len(sizes) > MAX_IMAGES:
        raise ImageError(f"{len(sizes)} images in one prompt, over the limit of {MAX_IMAGES}")
    runs = [n for _, n in image_runs(ids, spec)]
    want = [spec.tokens(*s) for s in sizes]
    if runs != want:
        raise ImageError(f"the prompt's image token runs {runs} do not match its images, which need {want} tokens")


@dataclass
class VisionInputs:
    """The vision encoder's inputs for a batch's images, in prompt order: pixel patches and their grids."""

    pixel_values: torch.Tensor  # [sum of patches, channels * temporal * patch * patch]
    grid_thw: torch.Tensor  # [images, 3]: temporal, height and width in patches

    def tokens_per_image(self, merge_size: int) -> list[int]:
        return [int(t * h * w) // merge_size**2 for t, h, w in self.grid_thw.tolist()]


def _processor(spec: VisionSpec) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        image_mean=list(spec.image_mean),
        image_std=list(spec.image_std),
    )


def pixel_inputs(images: Sequence[bytes], spec: VisionSpec, dtype: Any = None) -> VisionInputs | None:
    """The encoder inputs of these images (None for none), computed as transformers' processor does."""
    if not images:
        return None
    out = _processor(spec)(images=[decode(b, f"image {i}") for i, b in enumerate(images)], return_tensors="pt")
    pixels = out["pixel_values"]
    return VisionInputs(pixels if dtype is None else pixels.to(dtype), out["image_grid_thw"])


def patches_per_image(grid_thw: torch.Tensor) -> list[int]:
    return [int(math.prod(g)) for g in grid_thw.tolist()]
