"""`inference.backend = "auto"`: the embedded engine for small models, vLLM for large ones, decided once at load.

    rollflow rl / eval -> check_backend (rollflow/cli.py) -> `choose`:
        parameters  = the model's shape (model.path's config.json, filled in by modeldir.resolve, or the built-in
                      decoder's [model] keys), counted without torch (`count_params`)
        vllm usable = its environment's interpreter exists (inference.vllm.python) and the backend's capability
                      check (engines/inference/backend.py `check`) accepts the run's settings
        -> "vllm" when parameters >= inference.auto_vllm_min_params and vllm is usable, else "embedded"
    -> the choice replaces "auto" in the run config (config/run.json and every component's config carry it), so
       the inference process, `rollflow resume` and `--resume` (which keeps the stored choice) use the same one.

The default threshold is where benchmark 8 (tests/bench/backends.py, docs/benchmarks.md) measured vLLM CPU
overtaking the embedded engine on one thread at fixed length; below it vLLM's per-step cost (scheduler, HTTP, a
process hop) outweighs its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config.model import ModelConfig
    from config.run import RunConfig

AUTO = "auto"
CHAR_VOCAB = 100  # the built-in character tokenizer's size, near enough for a count that decides a threshold


@dataclass(frozen=True)
class Choice:
    backend: str
    params: int
    reason: str

    def line(self) -> str:
        return f'inference.backend = "auto" chose {self.backend!r}: {self.reason}'


def count_params(mc: ModelConfig, vocab: int) -> int:
    """Weights of a Llama/Qwen3-shaped decoder (dense or MoE) of this shape: embeddings, an untied head, and per
    layer attention, MLP or experts + router, norms."""
    h, hd = mc.hidden_size, mc.head_size
    attn = h * mc.num_heads * hd * 2 + h * mc.num_kv_heads * hd * 2 + (2 * hd if mc.qk_norm else 0)
    if mc.num_experts:
        width = mc.moe_intermediate_size or mc.intermediate_size
        mlp = mc.num_experts * 3 * h * width + h * mc.num_experts
    else:
        mlp = 3 * h * mc.intermediate_size
    embed = vocab * h * (1 if mc.tie_word_embeddings else 2)
    return embed + mc.num_layers * (attn + mlp + 2 * h) + h


def model_params(mc: ModelConfig) -> int:
    """The run's model's parameter count: model.path's config.json (through modeldir.resolve), else [model]'s shape."""
    from engines.models.modeldir import resolve

    source = resolve(mc)
    vocab = source.cfg.vocab_size or (source.hf_config or {}).get("vocab_size") or CHAR_VOCAB
    if source.hf_config and "text_config" in source.hf_config:  # a VLM: its text model's vocabulary
        vocab = source.cfg.vocab_size or source.hf_config["text_config"].get("vocab_size") or vocab
    return count_params(source.cfg, int(vocab))


def vllm_refusal(cfg: RunConfig, vision: bool) -> str | None:
    """Why the vllm backend cannot serve this run (no environment, or a setting its capabilities refuse), or None."""
    from engines.inference.backend import check
    from engines.inference.vllm.processes import ROOT
    from engines.registry import PluginError

    python = Path(cfg.inference.vllm.python)
    python = python if python.is_absolute() else ROOT / python
    if not python.exists():
        return f"no vLLM environment ({python} does not exist; infra/vllm/setup.sh makes it)"
    as_vllm = cfg.inference.model_copy(update={"backend": "vllm"})
    try:
        check(as_vllm, cfg.weight_broadcast, cfg.orchestrator, cfg.trainer, vision=vision)
    except PluginError as exc:
        return "the vllm backend refuses these settings: " + str(exc).split("\n", 1)[-1].strip()
    return None


def choose(params: int, min_params: int, refusal: str | None) -> Choice:
    """vllm when the model has at least `min_params` parameters and vllm can serve the run (`refusal` None)."""
    size = f"{params / 1e6:.1f}M parameters"
    if params < min_params:
        return Choice("embedded", params, f"{size} < inference.auto_vllm_min_params = {min_params / 1e6:.1f}M")
    if refusal is not None:
        return Choice("embedded", params, f"{size} >= {min_params / 1e6:.1f}M, but {refusal}")
    return Choice("vllm", params, f"{size} >= inference.auto_vllm_min_params = {min_params / 1e6:.1f}M")


def resolve_auto(cfg: RunConfig, vision: bool) -> Choice | None:
    """Replace inference.backend = "auto" in `cfg` by its choice (returned); None when the backend is named."""
    if cfg.inference.backend != AUTO:
        return None
    params = model_params(cfg.model)
    refusal = vllm_refusal(cfg, vision) if params >= cfg.inference.auto_vllm_min_params else None
    choice = choose(params, cfg.inference.auto_vllm_min_params, refusal)
    cfg.inference.backend = choice.backend
    cfg.inference._auto = True
    return choice


def keep_stored(cfg: RunConfig, stored: dict) -> str | None:
    """A `--resume` of a run whose backend "auto" chose: the stored choice, not a new one (the vLLM environment may
    have appeared or gone since). Returns the log line when it replaced the new choice, else None."""
    before = (stored.get("inference") or {}).get("backend")
    if not cfg.inference._auto or before in (None, AUTO, cfg.inference.backend):
        return None
    chose, cfg.inference.backend = cfg.inference.backend, before
    return f'inference.backend = "auto": resuming with the run\'s stored choice {before!r} (now it would be {chose!r})'
