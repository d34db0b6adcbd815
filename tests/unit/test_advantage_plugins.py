"""Advantage estimators as configuration: the built-ins' registration, the profile keys (legacy
`normalize_advantages` included), and a plugin package outside rollflow (tests/plugins/pkg/toyalgos) loaded by
entry point (a dist-info on the path, tests/algo_fixture.py) and by import path through the real CLI, with each
bad plugin refused at load (exit code 2) naming the key and what is valid."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from config.advantage import BUILTIN_PARAMS, AdvantageConfig
from config.loader import ConfigError, load_run_config
from config.registry import ADVANTAGE_GROUP, ADVANTAGES, registered
from engines.orchestrator import estimators
from engines.orchestrator.advantages import AdvantageSpec
from rollflow.cli import main
from tests.algo_fixture import ROOT, dry_run, on_path, write_site

TINY = ROOT / "profiles" / "tiny-cpu.toml"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return write_site(tmp_path_factory.mktemp("site"))


@pytest.fixture
def installed(site, monkeypatch):
    yield from on_path(site, monkeypatch)


def test_builtins_are_entry_points_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][ADVANTAGE_GROUP] == ADVANTAGES
    assert set(ADVANTAGES) == set(BUILTIN_PARAMS)
    for name in ADVANTAGES:
        est = estimators.load(AdvantageConfig(type=name))
        assert isinstance(est.spec, AdvantageSpec) and est.spec.params is BUILTIN_PARAMS[name]


def test_profile_keys_and_the_legacy_spelling():
    cfg = load_run_config([TINY])
    assert cfg.orchestrator.advantage == AdvantageConfig()  # grpo, normalize_std (default true)
    assert estimators.load(cfg.orchestrator.advantage).params.model_dump() == {"normalize_std": True, "eps": 1e-4}
    legacy = load_run_config([TINY], [("orchestrator.normalize_advantages", "false")]).orchestrator.advantage
    assert (legacy.type, legacy.normalize_std) == ("grpo", False)
    same = [("orchestrator.normalize_advantages", "true"), ("orchestrator.advantage.type", "grpo")]
    assert load_run_config([TINY], same).orchestrator.advantage.normalize_std is True
    refused = {
        "orchestrator.normalize_advantages = true .* disagrees with \\[orchestrator.advantage\\]": [
            ("orchestrator.normalize_advantages", "true"), ("orchestrator.advantage.type", "rloo")],
        "normalize_advantages = false .* normalize_std = True": [
            ("orchestrator.normalize_advantages", "false"), ("orchestrator.advantage.normalize_std", "true")],
        "normalize_std does not apply to type = 'rloo'; its parameters: \\(none\\)": [
            ("orchestrator.advantage", '{type = "rloo", normalize_std = false}')],
        "`args` is for plugin estimators; type = 'grpo' takes .*normalize_std, eps": [
            ("orchestrator.advantage.args", "{scale = 2}")],
        "a plugin estimator \\(type = 'toyalgos:RANK'\\) takes its parameters under `args`": [
            ("orchestrator.advantage", '{type = "toyalgos:RANK", eps = 0.1}')],
        "neither a built-in \\(grpo, reinforce_pp, rloo\\)": [("orchestrator.advantage.type", "no such")],
        "orchestrator.overlong.buffer=12 must be less than orchestrator.max_new_tokens=12": [
            ("orchestrator.overlong.buffer", "12")],
        "envs.0.advantage.eps: Input should be greater than 0": [
            ("envs", '[{id = "reverse-text", advantage = {type = "reinforce_pp", eps = 0}}]')],
    }  # fmt: skip
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_run_config([TINY], overrides)


def test_plugin_by_entry_point_and_by_import_path_through_the_cli(site, tmp_path):
    rank = '{type = "toyalgos:Specs.rank", args = {scale = 3.0}}'
    envs = f'[{{id = "reverse-text"}}, {{id = "sort-letters", advantage = {rank}}}]'
    r = dry_run(tmp_path, site, "--orchestrator.advantage", '{type = "rank", args = {scale = 2.0}}', "--envs", envs)
    assert r.returncode == 0, r.stderr
    stored = json.loads((tmp_path / "run" / "config" / "orchestrator.json").read_text())
    assert stored["orchestrator"]["advantage"]["type"] == "rank"
    assert stored["orchestrator"]["advantage"]["args"] == {"scale": 2.0}
    assert stored["envs"][1]["advantage"]["type"] == "toyalgos:Specs.rank"
    # without the dist-info the entry point is unknown: refused at load, the registered names listed
    r = dry_run(tmp_path / "b", None, "--orchestrator.advantage.type", "rank")
    assert r.returncode == 2 and "no advantage estimator named 'rank'" in r.stderr, r.stderr
    assert "registered: grpo, reinforce_pp, rloo" in r.stderr


def test_the_plugin_computes_rank_advantages(installed):
    assert registered(ADVANTAGE_GROUP, ADVANTAGES)["rank"] == "toyalgos:RANK"
    est = estimators.load(AdvantageConfig(type="rank", args={"scale": 2.0}))
    assert est([[0.1, 0.9, 0.5], [1.0, 1.0], [0.0, 1.0, 1.0, 0.2]]) == [
        [-2.0, 2.0, 0.0], [0.0, 0.0], [-2.0, 4 / 3, 4 / 3, -2 / 3]
    ]  # fmt: skip


BAD = {
    "unknown name": ('type = "rnak"', ["no advantage estimator named 'rnak'", "registered: grpo, rank, reinforce_pp"]),
    "missing module": ('type = "toyalgos_nowhere:RANK"', ["cannot import module 'toyalgos_nowhere'", "PYTHONPATH"]),
    "missing attribute": ('type = "toyalgos:RNK"', ["module 'toyalgos' has no attribute 'RNK'"]),
    "not a spec": (
        'type = "toyalgos:NOT_A_SPEC"',
        ["names a function, not an AdvantageSpec", "AdvantageSpec(fn, params)"],
    ),
    "no params class": (
        'type = "toyalgos:NO_PARAMS_CLASS"',
        ["AdvantageSpec.params is <class 'dict'>, not a pydantic"],
    ),
    "bad value": (
        'type = "rank"\nargs = {scale = 0}',
        ["bad parameters {'scale': 0}", "scale: Input should be greater"],
    ),
    "unknown arg": (
        'type = "rank"\nargs = {scael = 2}',
        ["scael: Extra inputs are not permitted", "RankParams takes: scale"],
    ),
    "wrong shape": (
        'type = "short"',
        ["advantage estimator 'short' returned 2 values for group 0, which has 3 rewards"],
    ),
    "not finite": ('type = "toyalgos:NOT_FINITE"', ["returned nan for group 0", "must be finite"]),
    "raises": ('type = "toyalgos:RAISES"', ["'toyalgos:RAISES' raised ZeroDivisionError"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plugin_is_refused_at_load_naming_the_key(installed, tmp_path, capsys, case):
    entry, expected = BAD[case]
    profile = tmp_path / "p.toml"
    profile.write_text(f'output_dir = "{tmp_path / "run"}"\n[orchestrator.advantage]\n{entry}\n')
    assert main(["rl", "@", str(TINY), "@", str(profile), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "invalid advantage estimator" in err and "orchestrator.advantage (type " in err
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_bad_per_env_estimator_names_its_entry(installed, tmp_path, capsys):
    envs = '[{id = "reverse-text"}, {id = "sort-letters", advantage = {type = "toyalgos:NOT_A_SPEC"}}]'
    code = main(["rl", "@", str(TINY), "--output-dir", str(tmp_path / "r"), "--envs", envs, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "command line (--envs): envs[1].advantage (type 'toyalgos:NOT_A_SPEC')" in err, err
    assert "orchestrator.advantage" not in err and "envs[0]" not in err
