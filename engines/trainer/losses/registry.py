"""`trainer.loss.type` -> the `LossSpec` that computes it and its validated parameters.

Built-in names resolve through config/registry.py's LOSSES (and every installed package's `rollflow.losses`
entry points); any other name is an entry point or an import path `module:attribute` (engines/registry.py).
A plugin's parameters are `trainer.loss.args`, validated by its own `params` model; every failure is a
PluginError naming the key and what would be valid.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from config.loss import BUILTIN_LOSSES, LossCommon, PluginLoss
from config.registry import LOSS_GROUP, LOSSES
from engines.registry import PluginError, load
from engines.trainer.losses.base import LossSpec


def resolve(loss: LossCommon) -> tuple[LossSpec, Any]:
    """The variant `trainer.loss` names and its parameters (a built-in's are the config model itself)."""
    spec = load("loss", loss.type, LOSS_GROUP, LOSSES)
    if not isinstance(spec, LossSpec):
        raise PluginError(
            f"trainer.loss.type = {loss.type!r} names a {type(spec).__name__}, not a LossSpec "
            "(engines/trainer/losses/base.py: LossSpec(fn, params))"
        )
    if loss.type in BUILTIN_LOSSES:
        return spec, loss
    assert isinstance(loss, PluginLoss)
    try:
        params = spec.params.model_validate(loss.args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(args)'}: {e['msg']}" for e in exc.errors())
        raise PluginError(f"trainer.loss.args for {loss.type!r}: {problems}") from None
    return spec, params
