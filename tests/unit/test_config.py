"""Config composition, overrides, error messages and the `--dry-run` CLI path (no torch imports)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from config.loader import ConfigError, load_run_config, parse_value
from config.process import InferenceProcessConfig, OrchestratorProcessConfig, SFTProcessConfig, TrainerProcessConfig
from config.run import RunConfig
from engines.models.tokenizer import CharTokenizer
from rollflow.cli import main, split_args

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "profiles" / "tiny-cpu.toml"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_profiles_compose_left_to_right(tmp_path):
    a = _write(
        tmp_path / "a.toml",
        'run_name = "a"\nseed = 1\n[trainer.optim]\nlr = 1e-3\nweight_decay = 0.1\n'
        '[[envs]]\nname = "reverse-text"\n[[envs]]\nname = "sort-letters"\n',
    )
    b = _write(tmp_path / "b.toml", 'run_name = "b"\n[trainer.optim]\nlr = 5e-4\n[[envs]]\nname = "sort-letters"\n')

    ab = load_run_config([a, b])
    assert ab.run_name == "b"  # later file wins
    assert ab.trainer.optim.lr == 5e-4
    assert ab.seed == 1  # keys only the earlier file sets survive
    assert ab.trainer.optim.weight_decay == 0.1  # nested tables merge key by key
    assert [e.name for e in ab.envs] == ["sort-letters"]  # arrays replace wholesale

    ba = load_run_config([b, a])
    assert ba.run_name == "a"
    assert ba.trainer.optim.lr == 1e-3
    assert [e.name for e in ba.envs] == ["reverse-text", "sort-letters"]


def test_split_args_and_dotted_overrides(tmp_path):
    a = _write(tmp_path / "a.toml", "[trainer.optim]\nlr = 1e-3\n")
    tokens = [
        "@", str(TINY), f"@{a}",
        "--trainer.optim.lr", "3e-4",
        "--output-dir=runs/x",
        "--orchestrator.temperature", "0.7",
        "--trainer.optim.betas", "[0.8, 0.95]",
        "--dry-run", "--overwrite",
    ]  # fmt: skip
    profiles, overrides, flags = split_args(tokens)
    assert profiles == [str(TINY), str(a)]
    assert overrides == [
        ("trainer.optim.lr", "3e-4"),
        ("output-dir", "runs/x"),
        ("orchestrator.temperature", "0.7"),
        ("trainer.optim.betas", "[0.8, 0.95]"),
    ]
    assert flags == {"dry-run", "overwrite"}

    cfg = load_run_config(profiles, overrides)
    assert cfg.trainer.optim.lr == 3e-4  # the override beats both profiles
    assert cfg.output_dir == "runs/x"  # dashes read as underscores
    assert cfg.orchestrator.temperature == 0.7
    assert cfg.trainer.optim.betas == (0.8, 0.95)
    # untouched keys still come from the profile
    assert cfg.model.hidden_size == tomllib.loads(TINY.read_text())["model"]["hidden_size"]


@pytest.mark.parametrize(
    "tokens",
    [["@"], ["--seed"], ["--seed", "--dry-run"], ["stray"]],
)
def test_split_args_rejects_malformed(tokens):
    with pytest.raises(ConfigError):
        split_args(tokens)


def test_unknown_key_in_file_names_file_and_valid_keys(tmp_path):
    bad = _write(tmp_path / "bad.toml", "[trainer]\nmicro_batch = 8\n")
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY, bad])
    msg = str(exc.value)
    assert str(bad) in msg
    assert "trainer.micro_batch" in msg
    for key in ("micro_batch_size", "num_threads", "optim", "loss", "measure_mismatch"):
        assert key in msg
    assert str(TINY) not in msg  # only the file that set the key is blamed


def test_unknown_key_on_command_line():
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY], [("orchestrator.group", "4")])
    msg = str(exc.value)
    assert "command line" in msg and "--orchestrator.group" in msg
    assert "group_size" in msg and "batch_size" in msg and "max_new_tokens" in msg


def test_unknown_key_inside_env_lists_env_keys():
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY], [("envs", '[{name = "reverse-text", maxchars = 9}]')])
    msg = str(exc.value)
    assert "envs.0.maxchars" in msg
    for key in ("args", "id", "name", "weight"):
        assert key in msg


def test_unknown_top_level_key(tmp_path):
    bad = _write(tmp_path / "bad.toml", "max_step = 3\n")
    with pytest.raises(ConfigError) as exc:
        load_run_config([bad])
    msg = str(exc.value)
    assert str(bad) in msg and "'max_step'" in msg and "max_steps" in msg and "async_level" in msg


def test_async_level_above_max_off_policy_rejected():
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY], [("async_level", "3"), ("max_off_policy_steps", "2")])
    msg = str(exc.value)
    assert "async_level=3" in msg and "max_off_policy_steps=2" in msg
    # values from the command line must not be blamed on "defaults", nor the whole config dumped
    assert "defaults" not in msg and "run_name" not in msg
    # equal is allowed
    cfg = load_run_config([TINY], [("async_level", "2"), ("max_off_policy_steps", "2")])
    assert cfg.async_level == 2


def test_max_seq_len_too_short_rejected():
    # tiny-cpu: max_chars 8 + 7 overhead tokens + 12 new tokens = 27
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY], [("model.max_seq_len", "26")])
    msg = str(exc.value)
    assert "model.max_seq_len=26" in msg and "orchestrator.max_new_tokens=12" in msg and ">= 27" in msg
    assert load_run_config([TINY], [("model.max_seq_len", "27")]).model.max_seq_len == 27
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_run_config([TINY], [("orchestrator.max_new_tokens", "50")])


def test_type_error_names_source_and_key():
    with pytest.raises(ConfigError) as exc:
        load_run_config([TINY], [("trainer.micro_batch_size", "many")])
    msg = str(exc.value)
    assert "--trainer.micro_batch_size" in msg and "trainer.micro_batch_size" in msg and "'many'" in msg


def test_missing_profile_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config([tmp_path / "nope.toml"])
    broken = _write(tmp_path / "broken.toml", "seed = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config([broken])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3e-4", 3e-4),
        ("42", 42),
        ("-1", -1),
        ("true", True),
        ("false", False),
        ("[1, 2]", [1, 2]),
        ('"quoted"', "quoted"),
        ("runs/a", "runs/a"),
        ("hello world", "hello world"),
        ("{a = 1}", {"a": 1}),
    ],
)
def test_parse_value(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_tiny_cpu_profile_validates():
    cfg = load_run_config([TINY])
    assert isinstance(cfg, RunConfig)
    assert cfg.run_name == "tiny-cpu"
    assert [e.name for e in cfg.envs] == ["reverse-text", "sort-letters"]
    assert cfg.async_level <= cfg.max_off_policy_steps


def test_cli_dry_run_writes_component_configs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    rc = main(["rl", "@", "profiles/tiny-cpu.toml", "--output-dir", str(out), "--seed", "7", "--dry-run"])
    assert rc == 0
    urls = json.loads(capsys.readouterr().out)
    assert set(urls) == {"sft", "inference", "orchestrator", "trainer", "slurm", "slurm_placement"}

    cfg_dir = out / "config"
    run = json.loads((cfg_dir / "run.json").read_text())
    run_id = run.pop("run_id")
    assert run_id.startswith("tiny-cpu-")
    resolved = RunConfig.model_validate(run)
    assert resolved.output_dir == str(out) and resolved.seed == 7

    models = {
        "sft": SFTProcessConfig,
        "inference": InferenceProcessConfig,
        "orchestrator": OrchestratorProcessConfig,
        "trainer": TrainerProcessConfig,
    }
    for name, model in models.items():
        path = cfg_dir / f"{name}.json"
        assert urls[name] == str(path)
        sub = model.model_validate(json.loads(path.read_text()))
        assert sub.run.run_id == run_id
        assert sub.run.output_dir == str(out)
        assert sub.seed == 7
    trainer = TrainerProcessConfig.model_validate(json.loads((cfg_dir / "trainer.json").read_text()))
    assert trainer.model == resolved.model and trainer.max_off_policy_steps == resolved.max_off_policy_steps
    orch = OrchestratorProcessConfig.model_validate(json.loads((cfg_dir / "orchestrator.json").read_text()))
    assert orch.envs == resolved.envs and orch.async_level == resolved.async_level
    assert not (out / "weights").exists() and not (out / "rollouts").exists()  # dry run starts nothing


def test_cli_bad_key_returns_2_with_message_on_stderr(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["rl", "@", str(TINY), "--output-dir", str(out), "--trainer.optim.learning_rate", "1e-3", "--dry-run"])
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "trainer.optim.learning_rate" in captured.err
    assert "command line" in captured.err and "lr" in captured.err and "max_grad_norm" in captured.err
    assert not out.exists()


def test_cli_help_returns_0(capsys):
    assert main(["rl", "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out


def test_group_size_above_engine_batch_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_run_config([TINY], [("orchestrator.group_size", "16"), ("inference.max_batch_size", "8")])
    assert "orchestrator.group_size=16" in str(err.value) and "inference.max_batch_size=8" in str(err.value)


def test_unknown_environment_and_backend_name_the_registry():
    with pytest.raises(ConfigError) as err:
        load_run_config([TINY], [("inference.backend", "tgi")])
    assert "inference.backend" in str(err.value) and "embedded" in str(err.value)
    # an env id is resolved (imported) by the run-level load step: tests/unit/test_env_plugins.py
    with pytest.raises(ConfigError) as err:
        load_run_config([TINY], [("envs", '[{id = "not a name"}]')])
    assert "not a name" in str(err.value) and "reverse-text" in str(err.value)


def _model_dir(path: Path, **config) -> Path:
    """A model directory as the load step reads it: config.json, weight files (their contents are read only when
    a process builds the model) and a tokenizer (the load step measures the environments' prompts with it)."""
    path.mkdir()
    hf = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    hf |= {"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "head_dim": 16}
    (path / "config.json").write_text(json.dumps({**hf, **config}))
    (path / "model.safetensors").write_bytes(b"")
    CharTokenizer().save_pretrained(path)
    return path


# A model directory makes prompts `instruct` sentences (~60 tokens through the character tokenizer), which the load
# step measures against model.max_seq_len with orchestrator.max_new_tokens.
LONG = ("--model.max-seq-len", "128")


def _cli_refuses(capsys, out: Path, *args: str) -> str:
    assert main(["rl", "@", str(TINY), "--output-dir", str(out), "--dry-run", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # refused before anything is written
    return captured.err


def test_cli_refuses_a_model_path_that_does_not_exist_at_load(tmp_path, capsys):
    err = _cli_refuses(capsys, tmp_path / "run", "--model.path", str(tmp_path / "nope"))
    assert f"model.path='{tmp_path / 'nope'}': not a directory" in err and "Traceback" not in err
    err = _cli_refuses(capsys, tmp_path / "run", "--model.path", "s3://bucket/model")
    assert "model.path='s3://bucket/model': a URL; model directories are read from the local filesystem" in err
    (tmp_path / "empty").mkdir()
    err = _cli_refuses(capsys, tmp_path / "run", "--model.path", str(tmp_path / "empty"))
    assert f"{tmp_path / 'empty' / 'config.json'}: missing" in err


def test_cli_refuses_tensor_parallelism_on_moe_layers_at_load(tmp_path, capsys):
    moe = ("--model.num_experts", "4", "--model.qk_norm", "true", "--trainer.parallel.world_size", "2")
    err = _cli_refuses(capsys, tmp_path / "run", *moe, "--trainer.parallel.tp", "2")  # the profile's shape
    assert "trainer.parallel.tp=2 on a MoE model (model.num_experts=4)" in err and "set tp = 1" in err
    model = _model_dir(tmp_path / "moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    tp = ("--trainer.parallel.world_size", "2", "--trainer.parallel.tp", "2")
    err = _cli_refuses(capsys, tmp_path / "run", "--model.path", str(model), *tp)  # config.json's shape
    assert f"{model}/config.json" in err and "trainer.parallel.tp=2 on a MoE model (model.num_experts=4)" in err
    dense = _model_dir(tmp_path / "dense", model_type="qwen3")
    ok = ("--output-dir", str(tmp_path / "ok"), "--dry-run", "--model.path", str(dense))
    assert main(["rl", "@", str(TINY), *ok, *tp, *LONG]) == 0


def test_inference_admission_limits_must_admit_the_orchestrators_load():
    """The server's admission limits never refuse the orchestrator's own requests: a run whose limits would is
    refused at load, naming the key and the value that fits; an unset token budget rises to the load."""
    load_run_config([TINY])
    with pytest.raises(ConfigError, match=r"inference.max_queued_requests >= 16"):
        load_run_config([TINY], [("inference.max_queued_requests", "8")])
    with pytest.raises(ConfigError, match=r"inference.max_queued_tokens >= 8192"):  # 16 requests x 8 x 64
        load_run_config([TINY], [("inference.max_queued_tokens", "8000")])
    cfg = load_run_config([TINY], [("orchestrator.requests_in_flight", "200")])  # over 4 batches: the budget rises
    assert cfg.inference.queued_tokens(cfg.model.max_seq_len) == 200 * 8 * 64 > 4 * 256 * 64
