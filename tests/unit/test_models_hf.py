"""Hugging Face model directories: per family, rollflow's custom model and `impl = "hf"` give transformers'
own logprobs (fp32, 1e-5), the engine samples with both, publications load with `from_pretrained`
exactly, and bad directories are refused naming the file."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")

from config.model import ModelConfig  # noqa: E402
from engines.inference.embedded.generate import generate  # noqa: E402
from engines.models import modeldir  # noqa: E402
from engines.models.decoder import token_logprobs  # noqa: E402
from engines.models.tokenizer import CharTokenizer  # noqa: E402
from storage import weights  # noqa: E402
from storage.fs import get_fs  # noqa: E402

TOK = CharTokenizer()
SHAPE = {
    "vocab_size": TOK.vocab_size,
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 80,
    "max_position_embeddings": 64,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-6,
}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "llama-untied-bias": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False, attention_bias=True),
    # Qwen3's head_dim is its own field (here not hidden_size // heads)
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from the near-uniform default init, so every tensor and position matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model.eval()


def make_dir(path, kind: str, seed: int = 0):
    """A Hugging Face model directory of a random tiny model of `kind`, with a chat-template tokenizer."""
    torch.manual_seed(seed)
    hf = _randomize(transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()), seed)
    hf.save_pretrained(str(path))
    TOK.save_pretrained(path)
    return hf


def _ids(batch: int = 3, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, TOK.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model(ids)[:, :-1], ids[:, 1:], 1.0)


def _hf_logprobs(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:], 1.0)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("impl", ["custom", "hf"])
def test_logprobs_match_transformers(tmp_path, kind, impl):
    hf = make_dir(tmp_path, kind)
    loaded = modeldir.load(ModelConfig(path=str(tmp_path), impl=impl), pretrained=True)
    assert loaded.source.impl == impl
    ids = _ids()
    want = _hf_logprobs(hf, ids)
    got = _logprobs(loaded.model, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert want.std() > 0.5  # random weights, not a near-uniform distribution


def test_auto_picks_custom_for_registered_families_and_hf_otherwise(tmp_path):
    make_dir(tmp_path / "llama", "llama")
    assert modeldir.resolve(ModelConfig(path=str(tmp_path / "llama"))).impl == "custom"
    src = modeldir.resolve(ModelConfig(path=str(tmp_path / "llama")))
    assert (src.cfg.hidden_size, src.cfg.num_layers, src.cfg.head_size, src.cfg.family) == (48, 2, 12, "llama")
    make_dir(tmp_path / "qwen3", "qwen3")
    q = modeldir.resolve(ModelConfig(path=str(tmp_path / "qwen3")))
    assert (q.impl, q.cfg.qk_norm, q.cfg.head_size, q.cfg.rope_theta) == ("custom", True, 16, 5000.0)
    # an unregistered model_type runs on transformers' modeling
    hf_cfg = transformers.MistralConfig(**SHAPE, head_dim=12)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(str(tmp_path / "mistral"))
    TOK.save_pretrained(tmp_path / "mistral")
    assert modeldir.resolve(ModelConfig(path=str(tmp_path / "mistral"))).impl == "hf"


@pytest.mark.parametrize("impl", ["custom", "hf"])
def test_engine_samples_with_either_impl(tmp_path, impl):
    """Cached, left-padded generation (the engine's path) gives the logprobs of a full forward."""
    make_dir(tmp_path, "qwen3")
    model = modeldir.load(ModelConfig(path=str(tmp_path), impl=impl), pretrained=True).model
    prompts = [TOK.render_prompt("rev:abc"), TOK.render_prompt("sort:hello"), TOK.render_prompt("rev:q")]
    outs = generate(
        model, prompts, max_new_tokens=[6, 4, 8], temperatures=[1.0, 0.7, 1.0], eos_id=-1, pad_id=TOK.pad_id,
        seeds=[1, 2, 3],
    )  # fmt: skip
    for prompt, out, temp in zip(prompts, outs, [1.0, 0.7, 1.0], strict=True):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(seq)[:, len(prompt) - 1 : -1]
        want = token_logprobs(logits, torch.tensor([out.token_ids]), temp)[0]
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), impl


@pytest.mark.parametrize("kind", ["llama", "qwen3", "builtin"])
def test_publication_round_trips_through_from_pretrained(tmp_path, kind):
    if kind == "builtin":
        cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
    else:
        make_dir(tmp_path / "src", kind)
        cfg = ModelConfig(path=str(tmp_path / "src"))
    loaded = modeldir.load(cfg, pretrained=True)
    _randomize(loaded.model, seed=5)
    fs, root = get_fs(str(tmp_path / "run"))
    directory = weights.publish(fs, root, 3, loaded.model.publishable_state_dict(), loaded.publication_files())
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = loaded.model.weights_module().state_dict()
    theirs = back.state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    ids = _ids()
    assert torch.allclose(_hf_logprobs(back, ids), _logprobs(loaded.model, ids), atol=1e-5, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    assert tok.encode("rev:abc=", add_special_tokens=False) == TOK.encode("rev:abc=", bos=False)
    generation = json.loads(fs.cat_file(os.path.join(directory, "generation_config.json")))
    assert generation["eos_token_id"] == TOK.eos_id
    assert weights.extra_files(fs, directory).keys() >= {"config.json", "tokenizer.json", "generation_config.json"}


def test_delta_publications_export_as_hf_directories(tmp_path):
    from config.storage import StorageConfig

    loaded = modeldir.load(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), True)
    fs, root = get_fs(str(tmp_path / "run"), StorageConfig(weights_delta=True, weights_full_every=10))
    publisher = weights.Publisher(fs, root)
    files = loaded.publication_files()
    publisher.publish(1, loaded.model.publishable_state_dict(), files)
    with torch.no_grad():
        loaded.model.model.norm.weight.add_(0.5)
    d2 = publisher.publish(2, loaded.model.publishable_state_dict(), files)
    assert not os.path.exists(os.path.join(d2, "model.safetensors"))  # a delta
    weights.export_hf(fs, d2, str(tmp_path / "export"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert torch.equal(back.state_dict()["model.norm.weight"], loaded.model.model.norm.weight)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    make_dir(path, "llama")
    return path


def _copy(good_dir, tmp_path):
    shutil.copytree(good_dir, tmp_path / "m")
    return tmp_path / "m"


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del data[k]
    path.write_text(json.dumps(data))


def _refused(d, match: str, **cfg) -> None:
    with pytest.raises(modeldir.ModelDirError, match=match):
        modeldir.load(ModelConfig(path=str(d), **cfg), pretrained=True)


def test_refuses_a_path_that_is_neither_a_directory_nor_cached(tmp_path):
    _refused(tmp_path / "nope", r"model.path=.*not a directory.*rollflow models fetch")
    _refused("no-such-org/no-such-model", r"not in the local Hugging Face cache")


def test_refuses_bad_config_json(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path)
    (d / "config.json").unlink()
    _refused(d, r"config.json: missing")
    (d / "config.json").write_text("{not json")
    _refused(d, r"config.json: not valid JSON")
    (d / "config.json").write_text("{}")
    _refused(d, r"config.json: no model_type \(registered families: llama, qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe\)")


def test_refuses_unknown_model_type_with_impl_custom(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path)
    _edit_json(d / "config.json", model_type="gpt_neox")
    _refused(
        d, r"config.json: model.impl='custom' cannot run it: model_type 'gpt_neox' is not a registered", impl="custom"
    )


def test_refuses_unsupported_config_with_impl_custom_and_auto_falls_back(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path)
    scaling = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
    _edit_json(d / "config.json", rope_parameters=scaling)
    _refused(d, r"rope type 'llama3'", impl="custom")
    assert modeldir.resolve(ModelConfig(path=str(d))).impl == "hf"


def test_refuses_missing_or_mismatched_weights(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path)
    _edit_json(d / "config.json", intermediate_size=64)
    _refused(d, r"safetensors do not fit its config.json.*mlp")
    (d / "model.safetensors").unlink()
    _refused(d, r"model.safetensors: missing \(nor model.safetensors.index.json\)")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    _refused(d, r"index.json: lists shards that are missing")


def test_refuses_missing_tokenizer_or_chat_template(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path)
    _edit_json(d / "tokenizer_config.json", chat_template=None)
    _refused(d, r"tokenizer_config.json: no chat_template")
    (d / "tokenizer.json").unlink()
    _refused(d, r"no tokenizer files \(one of tokenizer.json")


def test_refuses_impl_hf_without_a_directory():
    with pytest.raises(modeldir.ModelDirError, match=r"model.impl='hf' needs model.path"):
        modeldir.resolve(ModelConfig(impl="hf"))


def test_fetch_names_what_is_known(tmp_path, monkeypatch):
    from engines.models import fetch

    with pytest.raises(fetch.FetchError, match=r"unknown model 'nope'; known: smollm2-135m"):
        fetch.fetch("nope")
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path))
    make_dir(tmp_path / "models" / "mine", "llama")  # a fetched (or hand-placed) model resolves by name
    assert modeldir.resolve(ModelConfig(path="mine")).directory == tmp_path / "models" / "mine"


def test_a_built_in_moe_model_is_built_with_sparse_blocks():
    from engines.models.moe import SparseMoeBlock

    cfg = ModelConfig(num_experts=4, num_experts_per_tok=2, qk_norm=True, hidden_size=32, num_layers=2)
    source = modeldir.resolve(cfg)
    assert source.cfg.family_name == "qwen3_moe"
    model = modeldir.build_model(source, TOK, pretrained=False)  # never a dense model for an MoE config
    assert sum(isinstance(m, SparseMoeBlock) for m in model.modules()) == 2
