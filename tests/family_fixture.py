"""The `mini_llama` model family plugin for the tests (tests/plugins/pkg/toyfamilies): the dist-info that
registers it, and a Hugging Face directory of its `model_type` holding rollflow's built-in model."""

from __future__ import annotations

import json
from pathlib import Path

from config.registry import MODEL_FAMILY_GROUP

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tests" / "plugins" / "pkg"
SHAPE = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}


def write_site(d: Path, entries: str = "mini_llama = toyfamilies:MINI_LLAMA") -> Path:
    """What `pip install toyfamilies` would leave in `d`: its dist-info with the entry point(s)."""
    info = d / "toyfamilies-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyfamilies\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{MODEL_FAMILY_GROUP}]\n{entries}\n")
    return d


def mini_llama_dir(out: Path, seed: int = 0, **shape: int) -> tuple[Path, Path]:
    """(a `llama` directory of rollflow's built-in model (random weights, the character tokenizer), the same
    files as a `mini_llama` directory whose config.json says `ffn_dim` for the MLP width)."""
    import torch

    from config.model import ModelConfig
    from engines.models import modeldir
    from storage import weights
    from storage.fs import get_fs

    torch.manual_seed(seed)
    loaded = modeldir.load(ModelConfig(**{**SHAPE, **shape}), pretrained=False)
    fs, root = get_fs(str(out / "llama"))
    llama = Path(weights.publish(fs, root, 0, loaded.model.publishable_state_dict(), loaded.publication_files()))
    mini = out / "mini"
    mini.mkdir(parents=True)
    for f in llama.iterdir():
        if f.name != "_manifest.json":
            (mini / f.name).write_bytes(f.read_bytes())
    config = json.loads((llama / "config.json").read_text())
    config["model_type"], config["ffn_dim"] = "mini_llama", config.pop("intermediate_size")
    (mini / "config.json").write_text(json.dumps(config))
    return llama, mini
