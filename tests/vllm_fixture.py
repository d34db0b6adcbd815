"""Publications for the vLLM backend's tests: rollflow's built-in model (random weights, Llama naming,
character tokenizer in HF format) committed the way the trainer commits them, as Hugging Face directories
(engines/models/modeldir.py's publication files next to model.safetensors).
"""

from __future__ import annotations

from pathlib import Path

from config.model import ModelConfig


def tiny_model(seed: int = 0):
    """(LoadedModel, its ModelConfig): the built-in decoder of the default shape."""
    import torch

    from engines.models import modeldir

    torch.manual_seed(seed)
    mc = ModelConfig()
    return modeldir.load(mc, pretrained=False), mc


def publish_hf(output_dir: Path, version: int, loaded) -> str:
    """Commit `loaded.model`'s weights as publication `version` with config.json and the tokenizer files."""
    from storage import weights
    from storage.fs import get_fs

    fs, root = get_fs(str(output_dir))
    return weights.publish(fs, root, version, loaded.model.publishable_state_dict(), loaded.publication_files())
