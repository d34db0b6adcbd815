"""`trainer.loss.type` -> the `LossSpec` that computes it and its validated parameters.

Built-in names resolve through config/registry.py's LOSSES (and every installed package's `rollflow.losses`
entry points); any other name is an entry point or an import path `module:attribute` (engines/registry.py).
A plugin's parameters are `trainer.loss.args`, validated by its own `params` model, and `probe` runs it once
on a small batch at load, so a plugin that raises or returns the wrong shapes fails before the run starts.
Every failure is a PluginError naming the key and what would be valid.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from config.loss import BUILTIN_LOSSES, LossCommon, PluginLoss
from config.registry import LOSS_GROUP, LOSSES
from engines.registry import PluginError, load
from engines.trainer.losses.base import LossInputs, LossSpec, LossTerms


def resolve(loss: LossCommon) -> tuple[LossSpec, Any]:
    """The variant `trainer.loss` names and its parameters (a built-in's are the config model itself)."""
    where = f"trainer.loss (type {loss.type!r})"
    try:
        spec = load("loss", loss.type, LOSS_GROUP, LOSSES)
    except PluginError as exc:
        raise PluginError(f"{where}: {exc}") from None
    if not isinstance(spec, LossSpec):
        raise PluginError(
            f"{where} names a {type(spec).__name__}, not a LossSpec (engines/trainer/losses/base.py: "
            "LossSpec(fn, params))"
        )
    if not (isinstance(spec.params, type) and issubclass(spec.params, BaseModel)):
        raise PluginError(f"{where}: LossSpec.params is {spec.params!r}, not a pydantic model class")
    if loss.type in BUILTIN_LOSSES:
        return spec, loss
    assert isinstance(loss, PluginLoss)
    try:
        params = spec.params.model_validate(loss.args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(args)'}: {e['msg']}" for e in exc.errors())
        takes = ", ".join(spec.params.model_fields) or "(none)"
        raise PluginError(f"{where}: bad args {loss.args}: {problems}; {spec.params.__name__} takes: {takes}") from None
    return spec, params


def probe(loss: LossCommon, spec: LossSpec, params: Any) -> None:
    """Run the variant once on a small made-up micro-batch (two samples of three tokens, one masked out) and
    check what it returns: shapes, types and finite values, so a broken plugin fails at load."""
    where = f"trainer.loss (type {loss.type!r})"
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    x = LossInputs(
        logprobs=logprobs,
        sampler_logprobs=logprobs.detach() - 0.05,
        proximal_logprobs=logprobs.detach(),
        advantages=torch.tensor([[1.0] * 3, [-0.5] * 3], dtype=torch.float64),
        mask=mask,
        sequence=torch.tensor([[0, 0, 0], [1, 1, -1]]),
        n_sequences=2,
    )
    try:
        terms = spec.fn(x, params)
    except Exception as exc:
        raise PluginError(f"{where} raised {type(exc).__name__}: {exc} on a two-sample test batch") from None
    if not isinstance(terms, LossTerms):
        raise PluginError(f"{where} returned a {type(terms).__name__}, not LossTerms")
    named = {"per_token": terms.per_token, "ratio": terms.ratio, "dropped": terms.dropped, "clipped": terms.clipped}
    named.update({f"metrics[{k!r}]": v for k, v in terms.metrics.items()})
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) or value.shape != mask.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PluginError(f"{where} returned {name} of shape {shape}; every output is [rows, tokens] = (2, 3)")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise PluginError(f"{where} returned a non-finite {name} on a test batch with finite inputs")
