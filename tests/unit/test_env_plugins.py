"""Environment plugins: a package outside rollflow (tests/plugins/pkg/toyenvs) loaded by a real entry
point (a dist-info written on the path, read by importlib.metadata) and by import path, each bad plugin's
load-time error through the CLI (exit code 2), the built-ins' registration, and reasoning-gym."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from config.envs import EnvSpec
from config.loader import ConfigError, load_run_config
from config.registry import ENV_GROUP, ENVIRONMENTS, registered
from engines.environments import plugins
from engines.environments.base import EnvMix, build
from rollflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tests" / "plugins" / "pkg"
TINY = ROOT / "profiles" / "tiny-cpu.toml"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding what `pip install toyenvs` would leave: its dist-info with the entry point."""
    d = tmp_path_factory.mktemp("site")
    info = d / "toyenvs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyenvs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENV_GROUP}]\ntoy-echo = toyenvs:echo\n")
    return d


@pytest.fixture
def installed(site, monkeypatch):
    monkeypatch.syspath_prepend(str(PKG))
    monkeypatch.syspath_prepend(str(site))
    yield
    for name in [m for m in sys.modules if m == "toyenvs" or m.startswith("toyenvs.")]:
        del sys.modules[name]


def _profile(tmp_path: Path, envs: str, name: str = "p.toml") -> Path:
    p = tmp_path / name
    p.write_text(f'output_dir = "{tmp_path / "run"}"\n{envs}')
    return p


def _rl(tmp_path, capsys, envs: str) -> tuple[int, str]:
    profile = _profile(tmp_path, envs)
    code = main(["rl", "@", str(TINY), "@", str(profile), "--dry-run"])
    return code, capsys.readouterr().err


def test_entry_point_plugin_from_an_outside_package(installed, tmp_path, capsys):
    assert registered(ENV_GROUP, ENVIRONMENTS)["toy-echo"] == "toyenvs:echo"
    envs = '[[envs]]\nid = "toy-echo"\nargs = {words = ["xy", "zw"], times = 3}\n'
    code, err = _rl(tmp_path, capsys, envs)
    assert code == 0, err
    stored = json.loads((tmp_path / "run" / "config" / "orchestrator.json").read_text())
    assert stored["envs"][0]["id"] == "toy-echo" and stored["envs"][0]["args"]["times"] == 3
    specs = load_run_config([TINY, tmp_path / "p.toml"]).envs
    mix = EnvMix(specs, seed=0)
    tasks = [mix.task(f"step=1/group={g}") for g in range(8)]
    assert {t.prompt for t in tasks} == {"echo:xy", "echo:zw"}
    assert all(t.answer == t.prompt[5:] * 3 and t.env == "toy-echo" for t in tasks)
    assert mix.reward(tasks[0], tasks[0].answer) == 1.0 and mix.reward(tasks[0], "no") == 0.0
    assert tasks == [EnvMix(specs, seed=0).task(f"step=1/group={g}") for g in range(8)]  # pure in (seed, key)


def test_import_path_plugin_with_a_dotted_attribute_and_its_own_name(installed):
    spec = EnvSpec(id="toyenvs:Factories.upper", name="shout", args={"word": "hey"}, weight=2)
    mix = EnvMix([spec, EnvSpec(id="reverse-text")], seed=1)
    tasks = [mix.task(str(k)) for k in range(60)]
    shouts = [t for t in tasks if t.env == "shout"]
    assert shouts and all(t.prompt == "Repeat HEY 1 times." for t in shouts)  # the plugin's own env label
    assert mix.reward(shouts[0], "HEY") == 1.0  # routed back to the plugin by the entry's name


BAD = {
    "missing module": ('id = "toyenvs_nowhere:load"', ["cannot import module 'toyenvs_nowhere'", "PYTHONPATH"]),
    "module fails": ('id = "toyenvs.broken:load"', ["importing module 'toyenvs.broken' failed", "toyenvs_missing"]),
    "missing attribute": ('id = "toyenvs:lod"', ["module 'toyenvs' has no attribute 'lod'", "echo"]),
    "missing nested": ('id = "toyenvs:Factories.lower"', ["toyenvs:Factories has no attribute 'lower'", "upper"]),
    "unknown name": ('id = "toy-echoo"', ["no environment named 'toy-echoo'", "toy-echo", "reverse-text"]),
    "not callable": ('id = "toyenvs:NOT_CALLABLE"', ["is a int, not a callable factory"]),
    "unknown arg": (
        'id = "toy-echo"\nargs = {time = 2}',
        ["bad args {'time': 2}", "unexpected keyword argument 'time'", "accepts: words, times, prompt_style"],
    ),
    "factory raises": ('id = "toyenvs:raises_on_args"', ["raised RuntimeError: no such level 'easy'"]),
    "args rejected": ('id = "toy-echo"\nargs = {times = 0}', ["raised ValueError: times must be >= 1"]),
    "wrong type": ('id = "toyenvs:returns_wrong_type"', ["returned a list, which is not an Environment"]),
    "bad sample": ('id = "toyenvs:bad_sample"', ["sample(rng) returned 'not a task', not a Task (a dataclass"]),
    "no prompt style": ('id = "toyenvs:Factories.upper"\nprompt = "tag"', ["takes no `prompt_style`"]),
    "legacy key": ('name = "toy-echo"\nmax_chars = 5', ["unexpected keyword argument 'max_chars'"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plugin_is_refused_at_load_naming_env_profile_and_fix(installed, tmp_path, capsys, case):
    entry, expected = BAD[case]
    code, err = _rl(tmp_path, capsys, f'[[envs]]\nid = "reverse-text"\n[[envs]]\n{entry}\n')
    assert code == 2
    assert f"{tmp_path / 'p.toml'}: envs[1]" in err and "envs[0]" not in err  # the good one passes
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_override_is_named_as_the_source(tmp_path, capsys):
    code = main(["rl", "@", str(TINY), "--output-dir", str(tmp_path / "r"), "--envs", '[{id = "nope.x:y"}]'])
    assert code == 2 and "command line (--envs): envs[0]" in capsys.readouterr().err


def test_builtins_are_entry_points_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][ENV_GROUP] == ENVIRONMENTS
    for name in ENVIRONMENTS:
        assert callable(plugins.resolve(name))


def test_unique_names_and_legacy_profiles():
    with pytest.raises(ConfigError, match="'reverse-text' is used by more than one"):
        load_run_config([TINY], [("envs", '[{id = "reverse-text"}, {name = "reverse-text", max_chars = 4}]')])
    cfg = load_run_config([TINY])  # `name = "reverse-text"` with top-level min_chars/max_chars
    assert [(e.id, e.args) for e in cfg.envs] == [
        ("reverse-text", {"min_chars": 3, "max_chars": 8}),
        ("sort-letters", {"min_chars": 3, "max_chars": 8}),
    ]
    with pytest.raises(ConfigError, match="model.max_seq_len=64 is too short"):
        load_run_config([TINY], [("envs", '[{id = "reverse-text", args = {max_chars = 60}}]')])


def test_plugin_subprocess_dry_run_finds_the_entry_point(site, tmp_path):
    """A fresh process (as each run component is) sees the plugin through PYTHONPATH alone."""
    profile = _profile(tmp_path, '[[envs]]\nid = "toy-echo"\n[[envs]]\nid = "toyenvs:bad_sample"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PKG), str(site)])}
    cmd = [sys.executable, "-m", "rollflow.cli", "rl", "@", str(TINY), "@", str(profile), "--dry-run"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "envs[1]" in r.stderr and "envs[0]" not in r.stderr, r.stderr


# reasoning-gym ------------------------------------------------------------------------------------------


def _byte_bpe_dir(d: Path) -> Path:
    """A byte-level tokenizer (every text round-trips) with a ChatML template, as chat models ship."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for special in ("<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=template)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    hf.save_pretrained(str(d))
    return d


RG = {"id": "reasoning-gym", "name": "rg-spell", "args": {"dataset": "spell_backward", "config": {"max_word_len": 6}}}


def test_reasoning_gym_samples_renders_and_scores(tmp_path):
    pytest.importorskip("reasoning_gym")
    from engines.models.tokenizer import HFTokenizer

    mix = EnvMix([EnvSpec.model_validate(RG)], seed=7, default_style="instruct")
    keys = [f"step={s}/group={g}" for s in (1, 2) for g in range(6)]
    tasks = [mix.task(k) for k in keys]
    assert tasks == [EnvMix([EnvSpec.model_validate(RG)], seed=7).task(k) for k in keys]  # pure in (seed, key)
    assert len({t.prompt for t in tasks}) > 6 and all(t.env == "rg-spell" for t in tasks)
    for t in tasks:
        word = t.prompt.split("\n")[0].rsplit(": ", 1)[1]
        assert t.prompt.startswith("Spell this word backward") and t.prompt.endswith("Reply with the answer only.")
        assert 3 <= len(word) <= 6 and t.answer == word[::-1]
        assert mix.reward(t, f" {t.answer}\n") == 1.0  # reasoning-gym's own score_answer
        assert mix.reward(t, f"<answer>{t.answer}</answer>") == 1.0
        assert mix.reward(t, "") == 0.0
        assert 0.0 < mix.reward(t, t.answer[:-1] + "#") < 1.0  # spell_backward gives partial credit
    tok = HFTokenizer(_byte_bpe_dir(tmp_path / "tok"))
    ids = tok.render_prompt(tasks[0].prompt)
    rendered = f"<|im_start|>user\n{tasks[0].prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special=False) == rendered


def test_reasoning_gym_bad_args_are_clear():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(plugins.PluginError, match="unknown reasoning-gym dataset 'spell_backwards'.*spell_backward"):
        build(EnvSpec(id="reasoning-gym", args={"dataset": "spell_backwards"}))
    with pytest.raises(plugins.PluginError, match="bad config for spell_backward.*max_word_len"):
        build(EnvSpec(id="reasoning-gym", args={"dataset": "spell_backward", "config": {"max_len": 3}}))
    with pytest.raises(plugins.PluginError, match="invalid config for spell_backward: max_word_len must be"):
        build(EnvSpec(id="reasoning-gym", args={"dataset": "spell_backward", "config": {"max_word_len": 1}}))
    env = build(EnvSpec(id="reasoning-gym", args={"dataset": "basic_arithmetic", "seed": 3}))
    task = env.sample(random.Random(0))
    assert env.reward(task, task.answer) == 1.0 and env.reward(task, "nonsense") < 1.0


def test_resume_compares_legacy_env_entries_by_meaning():
    import inspect

    from config.envs import STRING_TASK_DEFAULTS
    from config.resume import resume_changes
    from engines.environments.base import reverse_text, sort_letters

    for factory in (reverse_text, sort_letters):
        params = inspect.signature(factory).parameters
        assert {k: params[k].default for k in STRING_TASK_DEFAULTS} == STRING_TASK_DEFAULTS
    new = load_run_config([TINY]).model_dump(mode="json")
    legacy = [{"name": n, "weight": 1.0, "min_chars": 3, "max_chars": 8, "lengths": "uniform", "prompt": "auto"}
              for n in ("reverse-text", "sort-letters")]  # fmt: skip
    assert resume_changes({**new, "envs": legacy}, new) == ({}, {})
    legacy[0]["max_chars"] = 7
    assert list(resume_changes({**new, "envs": legacy}, new)[0]) == ["envs"]
