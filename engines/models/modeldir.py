"""Where the policy model comes from, and what a publication holds besides the weights.

`resolve(ModelConfig) -> ModelSource`: without `model.path` the built-in model (its shape from the
config, the character tokenizer); with it, a Hugging Face directory (a local path, a name fetched by
`rollflow models fetch`, or `org/name` in the local Hugging Face cache, offline), checked file by file:
config.json (its `model_type` picks the family, engines/models/families.py, whose fields fill the
ModelConfig), safetensors weights, tokenizer files with a chat template. `model.impl` picks the code:
`custom` (engines/models/decoder.py, weights loaded by name), `hf` (transformers, engines/models/hf.py), or
`auto` (custom where the family is registered and its config supported, else hf).

`build_model`, `load_tokenizer` and `publication_files` (config.json, generation_config.json, tokenizer
files: what makes `weights/step=N/` a Hugging Face directory) are what the trainer, the warm-up and the
engine call.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.model import ModelConfig
from engines.models import families
from engines.models.tokenizer import CHAT_TEMPLATE, CharTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("rollflow.models")

# Vision-language families engines/models/vlm.py runs (transformers' modeling, model.impl = "hf").
VISION_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# Processor files a VLM publication copies from the model directory (vLLM's and transformers' processors read them).
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TOKENIZER_EXTRA = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "merges.txt",
    "added_tokens.json",
)


class ModelDirError(ValueError):
    """A model directory that cannot be used as configured; the message names the file and what is valid."""


@dataclass
class ModelSource:
    cfg: ModelConfig  # architecture fields filled from config.json when there is a directory
    impl: str  # "custom" or "hf"
    directory: Path | None = None
    hf_config: dict | None = None


def cache_dir() -> Path:
    """Where `rollflow models fetch` puts converted models: $ROLLFLOW_CACHE/models, ~/.cache/rollflow/models."""
    base = os.environ.get("ROLLFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollflow")
    return Path(base) / "models"


def resolve_dir(path: str) -> Path:
    """A local directory, a fetched model's name, or `org/name` from the local Hugging Face cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if (cache_dir() / path).is_dir():
        return cache_dir() / path
    if "://" in path:
        hint = "a URL; model directories are read from the local filesystem (a path every node mounts)"
    elif path.count("/") == 1 and not path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(path, local_files_only=True))
        except Exception as exc:  # not cached (offline), or not a valid repo id
            hint = f"not in the local Hugging Face cache ({type(exc).__name__})"
    else:
        hint = "not a directory"
    raise ModelDirError(
        f"model.path={path!r}: {hint}; give a Hugging Face model directory (config.json, *.safetensors, "
        f"tokenizer files), a name under {cache_dir()} (`rollflow models fetch NAME`), or an org/name that "
        "is in the local Hugging Face cache"
    )


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelDirError(f"{path}: missing; a Hugging Face model directory has a config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ModelDirError(f"{path}: no model_type (registered families: {', '.join(sorted(families.registered()))})")
    return data


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory: model.safetensors, or the shards its index lists."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ModelDirError(f"{index}: lists shards that are missing: {missing[:3]}")
        return [directory / s for s in shards]
    raise ModelDirError(
        f"{single}: missing (nor model.safetensors.index.json); rollflow loads safetensors weights only "
        "(convert .bin or GGUF checkpoints first, e.g. with transformers' save_pretrained)"
    )


def check_tokenizer_files(directory: Path) -> None:
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{directory}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)} is needed)")


def pick_impl(cfg: ModelConfig, hf: dict, config_path: Path) -> str:
    reason = families.unsupported(hf)
    if cfg.impl == "custom" and reason:
        raise ModelDirError(
            f"{config_path}: model.impl='custom' cannot run it: {reason}; registered families: "
            f"{', '.join(sorted(families.registered()))}; use model.impl = 'hf' (or 'auto') for transformers' modeling"
        )
    if cfg.impl == "auto":
        if reason:
            log.info(f"model.impl=auto: transformers' modeling ({reason})")
        return "hf" if reason else "custom"
    return cfg.impl


def check_vision(cfg: ModelConfig, hf: dict | None, config_path: Path | None) -> None:
    """A vision-language directory needs a registered VLM family (transformers' modeling of it is what
    engines/models/vlm.py drives); [model.vlm] needs a vision-language directory."""
    vision = isinstance((hf or {}).get("vision_config"), dict)
    if cfg.vlm is not None and not vision:
        where = f"{config_path} has no vision_config" if config_path else "model.path is not set"
        raise ModelDirError(f"[model.vlm] is set but {where}: it applies to vision-language model directories only")
    if vision and (hf or {}).get("model_type") not in VISION_FAMILIES:
        raise ModelDirError(
            f"{config_path}: a vision-language model of model_type {(hf or {}).get('model_type')!r}; rollflow runs "
            f"{', '.join(VISION_FAMILIES)} (engines/models/vlm.py)"
        )


def resolve(cfg: ModelConfig) -> ModelSource:
    """Check the model directory (if any) and settle the architecture and implementation."""
    if cfg.path is None:
        check_vision(cfg, None, None)
        hf_only = families.get(cfg.family_name).hf_only
        if hf_only:
            raise ModelDirError(f"model.family={cfg.family_name!r} needs model.path, a model directory: {hf_only}")
        if cfg.impl == "hf":
            raise ModelDirError(
                "model.impl='hf' needs model.path (a Hugging Face directory); without it "
                "rollflow builds its own model (impl 'auto' or 'custom')"
            )
        return ModelSource(cfg, "custom")
    directory = resolve_dir(cfg.path)
    hf = read_config(directory)
    weight_files(directory)
    check_tokenizer_files(directory)
    check_vision(cfg, hf, directory / "config.json")
    impl = pick_impl(cfg, hf, directory / "config.json")
    if impl == "custom":
        filled = cfg.model_copy(update=families.model_fields(hf))
    else:
        update: dict[str, Any] = {"tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}
        if hf.get("model_type") in VISION_FAMILIES:
            update["family"] = hf["model_type"]
        filled = cfg.model_copy(update=update)
    return ModelSource(ModelConfig.model_validate(filled.model_dump()), impl, directory, hf)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The built-in character tokenizer for the built-in model and for its publications (so a run that starts
    from one keeps the `tag` prompts it was trained on), else the directory's own tokenizer."""
    if source.directory is None or _is_char_publication(source.directory):
        return CharTokenizer()
    try:
        return HFTokenizer(source.directory)
    except ValueError as exc:
        raise ModelDirError(str(exc)) from exc
    except OSError as exc:
        raise ModelDirError(f"{source.directory}: the tokenizer does not load: {exc}") from exc


def _is_char_publication(directory: Path) -> bool:
    """A directory whose tokenizer files are the ones `CharTokenizer.save_pretrained` writes."""
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file() or not (directory / "tokenizer.json").is_file():
        return False
    try:
        template = json.loads(config_path.read_text()).get("chat_template")
        signature = _file_signature(directory)
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return template == CHAT_TEMPLATE and signature is not None and signature[0] == CharTokenizer().vocab


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken's {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_signature(source: ModelSource) -> tuple[dict[str, int], tuple[str | None, ...]] | None:
    """token -> id of every token, and the (bos, eos, pad) tokens, read from the files alone (no tokenizer
    library: the CLI checks this at load); None when the directory has no tokenizer.json to read."""
    if source.directory is None:
        char = CharTokenizer()
        return dict(char.vocab), tuple(char.inverse[i] for i in (char.bos_id, char.eos_id, char.pad_id))
    return _file_signature(source.directory)


def _file_signature(directory: Path) -> tuple[dict[str, int], tuple[str | None, ...]] | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [piece, score] at each id
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    vocab = {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    bos, eos, pad = (_token_text(config.get(f"{k}_token")) for k in ("bos", "eos", "pad"))
    return vocab, (bos, eos, pad or eos)


def check_same_tokenizer(student: ModelConfig, teacher: ModelConfig, key: str = "teacher.path") -> None:
    """Refuse a teacher whose token ids mean other tokens than the student's: it scores the student's ids as
    they are, so the vocabularies (token -> id) and the special tokens must be equal. Read from the tokenizer
    files; a directory without tokenizer.json has both tokenizers loaded and compared instead."""
    a_src, b_src = resolve(student), resolve(teacher)
    a, b = tokenizer_signature(a_src), tokenizer_signature(b_src)
    if a is None or b is None:
        a, b = _loaded_signature(a_src), _loaded_signature(b_src)
    (va, sa), (vb, sb) = a, b
    where = f"{key}={teacher.path!r}"
    student_name = student.path or "the built-in character tokenizer"
    if va != vb:
        differ = sorted(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
        raise ModelDirError(
            f"{where}: its tokenizer is not the student's ({student_name}): {len(vb)} vs {len(va)} tokens, "
            f"{len(differ)} differ (e.g. {differ[:3]}); a teacher scores the student's token ids, so it needs the "
            "same tokenizer: use a teacher of the student's model family (the same tokenizer files)"
        )
    if sa != sb:
        raise ModelDirError(
            f"{where}: its special tokens (bos, eos, pad) {sb} are not the student's {sa} ({student_name}); "
            "a teacher needs the same tokenizer"
        )


def _loaded_signature(source: ModelSource) -> tuple[dict[str, int], tuple[str | None, ...]]:
    tok = load_tokenizer(source)
    vocab = dict(tok.vocab) if isinstance(tok, CharTokenizer) else dict(tok.hf.get_vocab())  # type: ignore[attr-defined]
    inverse = {i: t for t, i in vocab.items()}
    return vocab, tuple(None if i is None else inverse.get(i) for i in (tok.bos_id, tok.eos_id, tok.pad_id))


def read_weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for f in weight_files(directory):
        state.update(load_file(str(f)))
    # buffers some older checkpoints saved; rollflow computes RoPE frequencies itself
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def build_model(source: ModelSource, tok: Tokenizer, pretrained: bool) -> Any:
    """The policy model in float32: rollflow's `CausalLM` or transformers' (`HFCausalLM`). With
    `pretrained` the directory's weights are loaded (by name); else the caller loads a publication."""
    if source.impl == "hf":
        from engines.models import hf, vlm

        assert source.directory is not None
        build = vlm.from_directory if is_vision(source) else hf.from_directory
        return build(str(source.directory), source.cfg, pretrained)
    from engines.models.decoder import CausalLM

    model = CausalLM(source.cfg, source.cfg.vocab_size or tok.vocab_size)
    if pretrained and source.directory is not None:
        try:
            model.load_published(read_weights(source.directory))
        except ValueError as exc:
            raise ModelDirError(f"{source.directory}: the safetensors do not fit its config.json: {exc}") from exc
    return model


def is_vision(source: ModelSource) -> bool:
    """Whether the source is a vision-language model (its config.json has a vision_config)."""
    return isinstance((source.hf_config or {}).get("vision_config"), dict)


def _special(tok: Tokenizer) -> dict[str, int | None]:
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def hf_config_json(source: ModelSource, tok: Tokenizer, vocab_size: int) -> dict:
    """A publication's config.json: the directory's own (weights now float32), or the built-in model's."""
    if source.hf_config is None:
        return families.hf_config(source.cfg, vocab_size, _special(tok))
    data = dict(source.hf_config)
    data["dtype"] = "float32"
    data.pop("torch_dtype", None)
    data.pop("quantization_config", None)
    for sub in ("text_config", "vision_config"):  # a VLM's parts carry their own dtype
        if isinstance(data.get(sub), dict):
            data[sub] = {k: v for k, v in data[sub].items() if k != "torch_dtype"} | {"dtype": "float32"}
    return data


def generation_config_json(source: ModelSource, tok: Tokenizer) -> dict:
    """The directory's generation_config.json (if any), its missing special token ids from the tokenizer."""
    data: dict = {}
    if source.directory is not None and (source.directory / "generation_config.json").is_file():
        data = json.loads((source.directory / "generation_config.json").read_text())
    for key, value in _special(tok).items():
        if data.get(f"{key}_token_id") is None:
            data[f"{key}_token_id"] = value
    return data


def tokenizer_files(tok: Tokenizer) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return {f.name: f.read_bytes() for f in sorted(Path(tmp).iterdir()) if f.is_file()}


def publication_files(source: ModelSource, tok: Tokenizer, vocab_size: int) -> dict[str, bytes]:
    """Everything besides the weights that makes a publication a Hugging Face model directory."""

    def dump(d: dict) -> bytes:
        return json.dumps(d, indent=1, sort_keys=True).encode()

    return {
        "config.json": dump(hf_config_json(source, tok, vocab_size)),
        "generation_config.json": dump(generation_config_json(source, tok)),
        **tokenizer_files(tok),
        **processor_files(source),
    }


def processor_files(source: ModelSource) -> dict[str, bytes]:
    """A VLM's image processor files, as the directory has them (preprocessor_config.json written from its
    VisionSpec when the directory lacks one); nothing for a text model."""
    if not is_vision(source) or source.directory is None:
        return {}
    from engines.models.vision import VisionSpec

    out = {n: (source.directory / n).read_bytes() for n in PROCESSOR_FILES if (source.directory / n).is_file()}
    if "preprocessor_config.json" not in out:
        spec = VisionSpec.from_directory(source.directory)
        out["preprocessor_config.json"] = json.dumps(spec.preprocessor_config(), indent=1).encode()
    return out


@dataclass
class LoadedModel:
    source: ModelSource
    tokenizer: Tokenizer
    model: Any  # CausalLM | HFCausalLM

    def publication_files(self) -> dict[str, bytes]:
        return publication_files(self.source, self.tokenizer, self.model.vocab_size)


def load(cfg: ModelConfig, pretrained: bool) -> LoadedModel:
    """Resolve, check and build: what the trainer, the warm-up and the engine start with."""
    source = resolve(cfg)
    tok = load_tokenizer(source)
    model = build_model(source, tok, pretrained)
    n = sum(p.numel() for p in model.parameters())
    where = source.directory or "built-in"
    log.info(f"model: {n / 1e6:.2f}M parameters, family {source.cfg.family_name}, impl {source.impl}, from {where}")
    return LoadedModel(source, tok, model)
