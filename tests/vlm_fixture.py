"""Shared by the vision-language tests: the tiny Qwen3-VL directory (engines/models/tiny_vlm.py, written once
per test session), its Qwen3-VL-MoE sibling, and small PNG images drawn from a seed."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest


def png(seed: int, width: int = 64, height: int = 64) -> bytes:
    """A PNG of random RGB pixels, the same for the same arguments."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    from engines.models import tiny_vlm

    return tiny_vlm.write(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_moe_dir(tmp_path_factory) -> Path:
    from engines.models import tiny_vlm

    return tiny_vlm.write(tmp_path_factory.mktemp("tiny-vlm-moe"), seed=0, moe=True)


# The embedded engine's and the inference server's tests (tests/unit/test_vlm_engine.py,
# tests/integration/test_vlm_server.py): the model loaded, image prompts, the model's own logprobs.
MAX_SEQ_LEN = 512  # the tiny VLM's max_position_embeddings


def token(t: str) -> int:
    from engines.models import tiny_vlm

    return tiny_vlm.TOKEN_ID[t]


def load(directory: Path):
    """The tiny VLM of `directory` (engines/models/vlm.py HFVisionLM), in float32, in eval mode."""
    from config.model import ModelConfig
    from engines.models import vlm

    return vlm.from_directory(str(directory), ModelConfig(max_seq_len=MAX_SEQ_LEN), pretrained=True).eval()


def prompt(text: str, images: list[bytes]) -> list[int]:
    """`<bos>`, one `<vision_start><image_pad><vision_end>` per image, `text=`, with each image_pad expanded: what
    the tiny VLM's chat template renders for image parts then a text part, and the orchestrator expands."""
    from engines.models import tiny_vlm, vision

    placeholder = [token("<|vision_start|>"), token("<|image_pad|>"), token("<|vision_end|>")]
    ids = [token("<bos>"), *placeholder * len(images), *map(token, text), token("=")]
    return vision.expand(ids, [vision.image_size(b) for b in images], tiny_vlm.spec())


def reference_logprobs(model, ids: list[int], images: list[bytes], tokens: list[int]) -> list[float]:
    """Each completion token's logprob (temperature 1, the image token masked as the engine masks it) from one full
    forward of prompt + completion, no cache."""
    import torch

    from engines.models import vision

    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens]), vision=vision.pixel_inputs(images, model.vision_spec))[0].float()
    logits[:, model.vision_spec.image_token_id] = float("-inf")  # never sampled (generate.py)
    logp = torch.log_softmax(logits, dim=-1)
    steps = torch.arange(len(ids) - 1, len(ids) + len(tokens) - 1)
    return logp[steps, torch.tensor(tokens)].tolist()
