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
