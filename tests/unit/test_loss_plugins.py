"""Policy losses as plugins: the built-ins' registration, and a loss outside rollflow
(tests/plugins/pkg/toyalgos/losses.py) loaded by entry point (a dist-info on the path, tests/algo_fixture.py)
and by import path through the real CLI, with each bad plugin refused at load (exit code 2) naming the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from config.loss import BUILTIN_LOSSES, PluginLoss
from config.registry import LOSS_GROUP, LOSSES, registered
from config.trainer import TrainerConfig
from engines.trainer.losses.base import LossSpec
from engines.trainer.losses.objective import Objective, StepCounts, TokenScores
from engines.trainer.losses.registry import resolve
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
    assert project["entry-points"][LOSS_GROUP] == LOSSES
    assert set(LOSSES) == set(BUILTIN_LOSSES)
    for model in BUILTIN_LOSSES.values():
        spec, params = resolve(model())
        assert isinstance(spec, LossSpec) and spec.params is model and isinstance(params, model)


def test_plugin_by_entry_point_and_by_import_path_through_the_cli(site, tmp_path):
    r = dry_run(tmp_path / "a", site, "--trainer.loss", '{type = "sign", args = {scale = 2.0}}')
    assert r.returncode == 0, r.stderr
    r = dry_run(tmp_path / "b", None, "--trainer.loss", '{type = "toyalgos.losses:Specs.sign", entropy_coef = 0.01}')
    assert r.returncode == 0, r.stderr
    # without the dist-info the entry point is unknown: refused at load, the registered names listed
    r = dry_run(tmp_path / "c", None, "--trainer.loss.type", "sign")
    assert r.returncode == 2 and "no loss named 'sign'" in r.stderr, r.stderr
    assert "registered: cispo, gspo, icepop, ipo, masked_is, mis, ppo_clip, tis" in r.stderr


def test_the_plugin_trains_through_the_objective(installed):
    assert registered(LOSS_GROUP, LOSSES)["sign"] == "toyalgos.losses:SIGN"
    objective = Objective(TrainerConfig(loss=PluginLoss(type="sign", args={"scale": 2.0})))
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    scores = TokenScores(
        logprobs=logprobs,
        sampler_logprobs=logprobs.detach(),
        advantages=torch.tensor([[0.3, 0.3], [-4.0, -4.0]], dtype=torch.float64),
        loss_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64),
        sequence=torch.tensor([[0, 0], [1, 1]]),
    )
    loss, stats = objective(scores, StepCounts(tokens=3.0, sequences=2.0))
    loss.backward()
    # token mean of -2 * sign(A): (-2 - 2 + 2) / 3, and the gradient -2 sign(A) / 3 per counted token
    assert float(loss.detach()) == pytest.approx(-2 / 3, abs=1e-12)
    expected = torch.tensor([[-2 / 3, -2 / 3], [2 / 3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-12)
    assert stats["loss/positive_sum"] == 2.0 and stats["tokens"] == 3.0


BAD = {
    "unknown name": ('type = "sgin"', ["no loss named 'sgin'", "registered: cispo, gspo, icepop"]),
    "missing module": ('type = "toyalgos_nowhere:SIGN"', ["cannot import module 'toyalgos_nowhere'", "PYTHONPATH"]),
    "missing attribute": ('type = "toyalgos.losses:SGN"', ["'toyalgos.losses' has no attribute 'SGN'"]),
    "not a spec": ('type = "toyalgos.losses:NOT_A_SPEC"', ["names a function, not a LossSpec"]),
    "no params class": ('type = "toyalgos.losses:NO_PARAMS_CLASS"', ["LossSpec.params is <class 'dict'>"]),
    "bad value": ('type = "sign"\nargs = {scale = 0}', ["bad args {'scale': 0}", "scale: Input should be greater"]),
    "unknown arg": ('type = "sign"\nargs = {scael = 2}', ["scael: Extra inputs", "SignParams takes: scale"]),
    "wrong shape": ('type = "toyalgos.losses:WRONG_SHAPE"', ["returned per_token of shape (2, 1)"]),
    "not finite": ('type = "toyalgos.losses:NOT_FINITE"', ["returned a non-finite per_token"]),
    "raises": ('type = "toyalgos.losses:RAISES"', ["raised ZeroDivisionError"]),
    "bad syntax": ('type = "not a name!"', ["neither a built-in", "import path `module:attribute`"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plugin_is_refused_at_load_naming_the_key(installed, tmp_path, capsys, case):
    entry, expected = BAD[case]
    profile = tmp_path / "p.toml"
    profile.write_text(f'output_dir = "{tmp_path / "run"}"\n[trainer.loss]\n{entry}\n')
    assert main(["rl", "@", str(TINY), "@", str(profile), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "trainer.loss" in err
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    assert not (tmp_path / "run").exists()  # refused before anything was written
