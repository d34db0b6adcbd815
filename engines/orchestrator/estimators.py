"""The configured advantage estimators, resolved, and applied to one step's groups.

    [orchestrator.advantage] / [[envs]] advantage (config/advantage.py)
        -> load: the AdvantageSpec its `type` names (built in, entry point or import path) + its params validated
    a step's scored groups (+ shaped rewards, engines/orchestrator/overlong.py)
        -> StepEstimators.apply: each env's groups go to its estimator; environments with the same estimator
           share one call (a batch-level one normalises over all their rows) -> `advantage` set on every row

`check` runs the loading once in the CLI process (rollflow/cli.py), so a bad plugin is refused at load, exit
code 2, naming the key; the orchestrator loads the same estimators at start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from config.advantage import AdvantageConfig
from config.envs import EnvSpec
from config.registry import ADVANTAGE_GROUP, ADVANTAGES
from engines import registry
from engines.orchestrator.advantages import AdvantageSpec, Groups
from engines.registry import PluginError
from storage.rollouts import RolloutRow


class AdvantageError(RuntimeError):
    """An estimator that raised or returned something other than one finite advantage per reward."""


@dataclass(frozen=True)
class Estimator:
    """A loaded estimator: its `type` as configured, its spec and its validated parameters."""

    name: str
    spec: AdvantageSpec
    params: BaseModel

    def __call__(self, groups: Groups) -> Groups:
        """The advantages of `groups` (each group's rewards), checked: one finite number per reward."""
        try:
            out = self.spec.fn([list(g) for g in groups], self.params)
        except Exception as exc:
            raise AdvantageError(f"advantage estimator {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        _check_shape(self.name, groups, out)
        return [[float(a) for a in group] for group in out]


def _check_shape(name: str, groups: Groups, out: Any) -> None:
    if not isinstance(out, list | tuple) or len(out) != len(groups):
        got = f"{len(out)} groups" if isinstance(out, list | tuple) else f"a {type(out).__name__}"
        raise AdvantageError(f"advantage estimator {name!r} returned {got} for {len(groups)} groups")
    for i, (rewards, advantages) in enumerate(zip(groups, out, strict=True)):
        if not isinstance(advantages, list | tuple) or len(advantages) != len(rewards):
            got = f"{len(advantages)} values" if isinstance(advantages, list | tuple) else repr(advantages)
            raise AdvantageError(
                f"advantage estimator {name!r} returned {got} for group {i}, which has {len(rewards)} rewards"
            )
        bad = [a for a in advantages if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a)]
        if bad:
            raise AdvantageError(
                f"advantage estimator {name!r} returned {bad[0]!r} for group {i} (rewards {rewards}); "
                "advantages must be finite numbers"
            )


def load(cfg: AdvantageConfig) -> Estimator:
    """The estimator `cfg.type` names with its parameters validated by its params class; PluginError says why not."""
    spec = registry.load("advantage estimator", cfg.type, ADVANTAGE_GROUP, ADVANTAGES)
    if not isinstance(spec, AdvantageSpec):
        raise PluginError(
            f"{cfg.type!r} names a {type(spec).__name__}, not an AdvantageSpec "
            "(engines/orchestrator/advantages.py: AdvantageSpec(fn, params))"
        )
    if not (isinstance(spec.params, type) and issubclass(spec.params, BaseModel)):
        raise PluginError(f"{cfg.type!r}: AdvantageSpec.params is {spec.params!r}, not a pydantic model class")
    try:
        params = spec.params.model_validate(cfg.params())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(args)'}: {e['msg']}" for e in exc.errors())
        fields = ", ".join(spec.params.model_fields) or "(none)"
        raise PluginError(
            f"bad parameters {cfg.params()}: {problems}; {spec.params.__name__} takes: {fields}"
        ) from None
    return Estimator(cfg.type, spec, params)


def _smoke(estimator: Estimator) -> None:
    """One call on a small batch, so an estimator that breaks on use fails at load too."""
    try:
        estimator([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    except AdvantageError as exc:
        raise PluginError(str(exc)) from None


def check(default: AdvantageConfig, envs: Sequence[EnvSpec], sources: Sequence[str]) -> None:
    """Load every configured estimator and call it once; one PluginError naming each bad one's key."""
    where = [("orchestrator.advantage", default)]
    for i, (env, source) in enumerate(zip(envs, sources, strict=True)):
        if env.advantage is not None:
            where.append((f"{source}: envs[{i}].advantage", env.advantage))
    problems = []
    for key, cfg in where:
        try:
            _smoke(load(cfg))
        except PluginError as exc:
            problems.append(f"{key} (type {cfg.type!r}): {exc}")
    if problems:
        raise PluginError("invalid advantage estimator:\n  " + "\n  ".join(problems))


class StepEstimators:
    """Each environment's estimator (its own `advantage`, else the orchestrator's), loaded once."""

    def __init__(self, default: AdvantageConfig, envs: Sequence[EnvSpec]):
        configs = {e.label: e.advantage or default for e in envs}
        self.default = default.key()
        self.env_key = {label: cfg.key() for label, cfg in configs.items()}
        self.by_key = {cfg.key(): load(cfg) for cfg in [default, *configs.values()]}

    def apply(self, groups: Sequence[list[RolloutRow]], rewards: Sequence[list[float]]) -> int:
        """Set every row's `advantage` from `rewards` (the rows' rewards, shaped; same nesting), each env's
        groups by its estimator, one call per estimator for the whole step; returns how many groups got only
        zero advantages (they add no gradient)."""
        batches: dict[str, list[int]] = {}
        for i, rows in enumerate(groups):
            if rows:
                batches.setdefault(self.env_key.get(rows[0].env, self.default), []).append(i)
        for key, members in batches.items():
            advantages = self.by_key[key]([rewards[i] for i in members])
            for i, values in zip(members, advantages, strict=True):
                for row, value in zip(groups[i], values, strict=True):
                    row.advantage = value
        return sum(1 for rows in groups if rows and all(r.advantage == 0.0 for r in rows))
