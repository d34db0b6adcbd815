"""The advantage estimator of a run (`[orchestrator.advantage]`), of one environment (`[[envs]] advantage`), and
DAPO's soft overlong punishment (`[orchestrator.overlong]`).

An estimator is named by `type`: a built-in (`grpo`, `rloo`, `reinforce_pp`: config/registry.py `ADVANTAGES`), an
entry point in the `rollflow.advantages` group, or an import path `module:attribute`. A built-in's parameters are
keys of the table itself, typed by its params model below (which is also the params class its `AdvantageSpec`
declares); a plugin's go under `args` and are validated by the plugin's own params class when the CLI loads it
(engines/orchestrator/estimators.py). Only the syntax of a plugin's `type` is checked here, so this module stays
pydantic-only. `orchestrator.normalize_advantages` (older profiles) reads as `type = "grpo"`, `normalize_std`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from config.base import Strict
from config.registry import ADVANTAGES, is_plugin_name

EPS = 1e-4  # added to every std a built-in divides by (what the group estimator always used)


class GrpoParams(Strict):
    """GRPO (Shao et al. 2024): reward - group mean, divided by the group's population std + eps."""

    normalize_std: bool = Field(True, description="divide the group-centred rewards by the group's std + eps")
    eps: float = Field(EPS, gt=0)


class RlooParams(Strict):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): reward - mean of the group's other rewards."""


class ReinforcePPParams(Strict):
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then normalised by the step batch's mean and std."""

    group_baseline: bool = Field(True, description="subtract the group mean before the batch normalisation")
    eps: float = Field(EPS, gt=0)


# type -> its params model; the `AdvantageSpec`s of engines/orchestrator/advantages.py declare the same classes.
BUILTIN_PARAMS: dict[str, type[BaseModel]] = {"grpo": GrpoParams, "rloo": RlooParams, "reinforce_pp": ReinforcePPParams}
# The built-ins' parameters, as keys of the `[orchestrator.advantage]` table (the union of the models' fields).
PARAM_KEYS = ("normalize_std", "group_baseline", "eps")


class AdvantageConfig(Strict):
    """One advantage estimator and its parameters (docs/algorithm.md, "Advantage estimators")."""

    type: str = Field(
        "grpo",
        description="grpo | rloo | reinforce_pp, an entry point name in the `rollflow.advantages` group, or an "
        "import path `module:attribute` naming an AdvantageSpec",
    )
    normalize_std: bool | None = Field(None, description="grpo: divide by the group std (default true)")
    group_baseline: bool | None = Field(None, description="reinforce_pp: subtract the group mean (default true)")
    eps: float | None = Field(None, gt=0, description="grpo, reinforce_pp: added to the std (default 1e-4)")
    args: dict[str, Any] = Field(default_factory=dict, description="a plugin estimator's parameters")

    @model_validator(mode="after")
    def _parameters_fit_the_type(self) -> AdvantageConfig:
        flat = {k: getattr(self, k) for k in PARAM_KEYS if getattr(self, k) is not None}
        model = BUILTIN_PARAMS.get(self.type)
        if model is None:
            _check_plugin_name(self.type)
            if flat:
                raise ValueError(
                    f"{', '.join(flat)}: parameters of the built-in estimators; a plugin estimator "
                    f"(type = {self.type!r}) takes its parameters under `args`"
                )
            return self
        takes = list(model.model_fields)
        if self.args:
            raise ValueError(
                f"`args` is for plugin estimators; type = {self.type!r} takes its parameters in the table itself: "
                f"{', '.join(takes) or '(none)'}"
            )
        wrong = [k for k in flat if k not in takes]
        if wrong:
            takes_text = ", ".join(takes) or "(none)"
            raise ValueError(f"{', '.join(wrong)} does not apply to type = {self.type!r}; its parameters: {takes_text}")
        return self

    def params(self) -> dict[str, Any]:
        """The parameters the estimator's params class validates: a built-in's keys that are set, a plugin's `args`."""
        if self.type in BUILTIN_PARAMS:
            return {k: getattr(self, k) for k in PARAM_KEYS if getattr(self, k) is not None}
        return dict(self.args)

    def key(self) -> str:
        """What tells estimators apart: environments with equal ones share one (a batch-level one normalises over
        all their rows)."""
        return self.model_dump_json()


def _check_plugin_name(name: str) -> None:
    if is_plugin_name(name):
        return
    raise ValueError(
        f"advantage type {name!r} is neither a built-in ({', '.join(sorted(ADVANTAGES))}), an entry point name in "
        "the `rollflow.advantages` group, nor an import path `module:attribute`"
    )


def with_legacy_normalize(data: dict) -> dict:
    """An `[orchestrator]` table with `normalize_advantages` (older profiles) read as `[orchestrator.advantage]`
    `type = "grpo"`, `normalize_std`; refused where an explicit `[orchestrator.advantage]` says otherwise."""
    if "normalize_advantages" not in data:
        return data
    data = dict(data)
    legacy = data.pop("normalize_advantages")
    if legacy is None:
        return data
    try:
        normalize = TypeAdapter(bool).validate_python(legacy)
    except ValidationError:
        raise ValueError(f"orchestrator.normalize_advantages must be true or false (got {legacy!r})") from None
    given = data.get("advantage")
    table = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else dict(given or {})
    kind, std = table.get("type", "grpo"), table.get("normalize_std", normalize)
    if kind != "grpo" or std != normalize:
        raise ValueError(
            f"orchestrator.normalize_advantages = {str(normalize).lower()} (older profiles' spelling of "
            f'[orchestrator.advantage] type = "grpo", normalize_std) disagrees with [orchestrator.advantage] '
            f"(type = {kind!r}, normalize_std = {std!r}); remove orchestrator.normalize_advantages"
        )
    data["advantage"] = {**table, "type": "grpo", "normalize_std": normalize}
    return data


class OverlongConfig(Strict):
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the reward the advantages are computed from."""

    buffer: int = Field(
        0, ge=0, description="tokens before orchestrator.max_new_tokens where the penalty ramps up; 0: off"
    )
    penalty: float = Field(1.0, ge=0, description="the penalty at (and beyond) max_new_tokens")
