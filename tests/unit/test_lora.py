"""LoRA: adapters on the built-in model, adapter publications (PEFT layout, checksummed base), the engine's
view of base + adapter, checkpoint parts, and the config rules."""

from __future__ import annotations

import json

import pytest
import torch

from config.model import LoRAConfig, ModelConfig
from config.storage import StorageConfig
from engines.models import lora
from engines.models.decoder import CausalLM
from storage import weights
from storage.fs import CorruptError, get_fs, read_manifest, read_verified
from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
IDS = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(1))


def _model(cfg: ModelConfig = CFG, adapters: LoRAConfig | None = LoRAConfig(rank=4), train: bool = True):
    torch.manual_seed(0)
    model = CausalLM(cfg, 64)
    lora.attach_to(model, adapters, train=train)
    return model.eval()


def _perturb(model) -> None:
    g = torch.Generator().manual_seed(2)
    for m in lora.adapted_modules(model).values():
        m.lora_B.weight.data.normal_(0, 0.05, generator=g)


def test_default_targets_adapt_every_projection_and_start_equal_to_the_base():
    base, adapted = _model(adapters=None), _model()
    names = sorted(lora.adapted_modules(adapted))
    assert len(names) == 2 * 7 and "model.layers.0.self_attn.q_proj" in names and "lm_head" not in names
    assert torch.equal(base(IDS), adapted(IDS))  # B = 0
    trainable, total = lora.trainable_fraction(adapted)
    assert 0 < trainable / total < 0.2
    assert all(lora.is_adapter_key(n) for n, p in adapted.named_parameters() if p.requires_grad)
    assert adapted.publishable_state_dict().keys() == base.publishable_state_dict().keys()


def test_unknown_names_are_ignored_but_a_config_matching_nothing_is_refused():
    assert len(lora.adapted_modules(_model(adapters=LoRAConfig(target_modules=["q_proj", "in_proj"])))) == 2
    with pytest.raises(ValueError, match="matches no Linear layer"):
        _model(adapters=LoRAConfig(target_modules=["in_proj", "out_proj"]))


def test_experts_target_adapts_the_experts_but_not_the_router():
    moe = ModelConfig(**{**CFG.model_dump(), "num_experts": 4, "num_experts_per_tok": 2, "lora": None})
    names = lora.adapted_modules(_model(moe, LoRAConfig(target_modules=["experts"])))
    assert len(names) == 2 * 4 * 3 and not any(n.endswith(".gate") for n in names)


def _publish(tmp_path, save_merged: bool = False):
    fs, root = get_fs(str(tmp_path / "run"), StorageConfig())
    model = _model(adapters=LoRAConfig(rank=4, save_merged=save_merged))
    publisher = weights.Publisher(fs, root)
    publisher.publish(0, model.publishable_state_dict())
    _perturb(model)
    lora.publish(publisher, model, LoRAConfig(rank=4, save_merged=save_merged), 1, {"config.json": b"{}"})
    return fs, root, model


def test_adapter_publication_is_peft_shaped_small_and_names_its_base(tmp_path):
    fs, root, model = _publish(tmp_path)
    directory = weights.version_dir(root, 1)
    manifest = read_manifest(fs, directory)
    base = read_manifest(fs, weights.version_dir(root, 0))
    assert manifest["encoding"] == "lora" and manifest["lora_base"]["model_sha256"] == base["model_sha256"]
    assert manifest["lora_base"]["path"] == "weights/step=000000" and manifest["base_version"] == 0
    assert manifest["payload_bytes"] < manifest["full_bytes"] / 3
    config = json.loads(read_verified(fs, directory, ADAPTER_CONFIG, manifest))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    from safetensors.torch import load

    keys = load(read_verified(fs, directory, ADAPTER_FILE, manifest)).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys


def test_engine_side_base_plus_adapter_equals_the_trainer_and_merged_export_is_close(tmp_path):
    fs, root, trainer = _publish(tmp_path, save_merged=True)
    engine = _model(train=False)  # another process: same shape, its own adapter init
    engine.load_published(weights.load(fs, weights.version_dir(root, 1)))
    assert torch.equal(engine(IDS), trainer(IDS))
    out = tmp_path / "export"
    weights.export_hf(fs, weights.version_dir(root, 1), str(out))
    plain = _model(adapters=None)
    from safetensors.torch import load_file

    plain.load_published(load_file(out / "model.safetensors"))
    assert not (out / ADAPTER_CONFIG).exists()
    torch.testing.assert_close(plain(IDS), trainer(IDS), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain(IDS), _model(adapters=None)(IDS), atol=1e-4)  # the adapter matters


def test_a_changed_base_is_refused(tmp_path):
    fs, root, model = _publish(tmp_path)
    weights.publish(fs, root, 0, {k: v + 1 for k, v in model.publishable_state_dict().items()})
    with pytest.raises(CorruptError, match="LoRA base"):
        weights.load(fs, weights.version_dir(root, 1))


def test_adapter_checkpoint_part_round_trips_and_refuses_another_shape():
    model = _model()
    _perturb(model)
    saved = lora.AdapterPart(model).state_dict()
    other = _model()
    lora.AdapterPart(other).load_state_dict(saved)
    assert torch.equal(other(IDS), model(IDS))
    with pytest.raises(ValueError, match="model.lora"):
        lora.AdapterPart(_model(adapters=LoRAConfig(target_modules=["q_proj"]))).load_state_dict(saved)


def test_config_refuses_lora_with_delta_publications():
    from config.run import RunConfig

    with pytest.raises(ValueError, match="weights_delta"):
        RunConfig.model_validate({"model": {"lora": {}}, "storage": {"weights_delta": True}})
    assert RunConfig.model_validate({"model": {"lora": {"rank": 4}}}).model.lora.target_modules[0] == "q_proj"


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_hf_impl_adapters_publish_and_load_like_the_custom_model(tmp_path, kind):
    pytest.importorskip("transformers")
    from test_models_hf import make_dir

    from engines.models import modeldir

    make_dir(tmp_path / "m", kind)
    cfg = ModelConfig(path=str(tmp_path / "m"), impl="hf", lora=LoRAConfig(rank=2))

    def load():
        model = modeldir.load(cfg, pretrained=True).model
        lora.attach_to(model, cfg.lora, train=True)
        return model.eval()

    trainer = load()
    names = lora.adapted_modules(trainer)
    assert "model.layers.0.self_attn.q_proj" in names and not any(n.endswith("mlp.gate") for n in names)
    fs, root = get_fs(str(tmp_path / "run"), StorageConfig())
    publisher = weights.Publisher(fs, root)
    publisher.publish(0, trainer.publishable_state_dict())
    _perturb(trainer)
    lora.publish(publisher, trainer, cfg.lora, 1, {})
    engine = load()
    engine.load_published(weights.load(fs, weights.version_dir(root, 1)))
    ids = IDS % 40 + 4
    assert torch.equal(engine(ids), trainer(ids))


def test_config_refuses_collective_transport_with_lora_or_vllm():
    from config.run import RunConfig

    with pytest.raises(ValueError, match='model.lora is not supported with weight_broadcast.type = "collective"'):
        RunConfig.model_validate({"model": {"lora": {}}, "weight_broadcast": {"type": "collective"}})
    from engines.inference.backend import check

    vllm = RunConfig.model_validate({"inference": {"backend": "vllm"}, "weight_broadcast": {"type": "collective"}})
    with pytest.raises(ValueError, match="needs a backend that joins the trainer's collective group.*'vllm'"):
        check(vllm.inference, vllm.weight_broadcast)  # the backend's capabilities, checked by the CLI at load
    with pytest.raises(ValueError, match="type"):
        RunConfig.model_validate({"weight_broadcast": {"type": "nccl"}})
    assert RunConfig().weight_broadcast.type == "filesystem" and RunConfig().weight_broadcast.host == "127.0.0.1"
