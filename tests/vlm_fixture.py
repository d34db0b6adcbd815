"""A tiny Qwen3-VL (engines/models/tiny_vlm.py, random weights, offline) and image prompts for the tests of the
embedded engine and the inference server on a vision-language model."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from config.model import ModelConfig
from engines.models import tiny_vlm, vision, vlm

T = tiny_vlm.TOKEN_ID
MAX_SEQ_LEN = 512  # the tiny VLM's max_position_embeddings


def load(directory: Path) -> vlm.HFVisionLM:
    """The tiny VLM written to `directory` (seed 0), loaded in float32."""
    tiny_vlm.write(directory, seed=0)
    return vlm.from_directory(str(directory), ModelConfig(max_seq_len=MAX_SEQ_LEN), pretrained=True).eval()


def png(color: str, size: tuple[int, int] = (64, 64)) -> bytes:
    """A PNG of a white square with a rectangle of `color` in it (different colors: different encoder inputs)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle([8, 8, size[0] // 2 + 8, size[1] - 14], fill=color)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def prompt(text: str, images: list[bytes]) -> list[int]:
    """`<bos>`, one `<vision_start><image_pad><vision_end>` per image, `text=`, with each image_pad expanded."""
    placeholder = [T["<|vision_start|>"], T["<|image_pad|>"], T["<|vision_end|>"]]
    ids = [T["<bos>"], *placeholder * len(images), *(T[c] for c in text), T["="]]
    return vision.expand(ids, [vision.image_size(b) for b in images], tiny_vlm.spec())


@torch.no_grad()
def reference_logprobs(model: vlm.HFVisionLM, ids: list[int], images: list[bytes], tokens: list[int]) -> list[float]:
    """Each completion token's logprob (temperature 1, the image token masked as the engine masks it) from one full
    forward of prompt + completion, no cache."""
    inputs = vision.pixel_inputs(images, model.vision_spec)
    full = torch.tensor([ids + tokens])
    logits = model(full, vision=inputs)[0].float()
    logits[:, model.vision_spec.image_token_id] = float("-inf")  # never sampled (generate.py)
    logp = torch.log_softmax(logits, dim=-1)
    steps = torch.arange(len(ids) - 1, len(ids) + len(tokens) - 1)
    return logp[steps, torch.tensor(tokens)].tolist()
