"""One environment of the task mix: which plugin to load (`id`), the arguments its factory gets
(`args`), its label in the lake (`name`), its share of the prompts (`weight`) and, optionally, the advantage
estimator of its groups (`advantage`, config/advantage.py; default: the orchestrator's).

Only the syntax of `id` is checked here: resolving it imports the plugin's module, which the run-level
load step does (engines/environments/plugins.py, called by the CLI), so this module stays import-light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from config.advantage import AdvantageConfig
from config.base import Strict
from config.registry import ENVIRONMENTS, STRING_TASKS, is_plugin_name

# `module.sub:attribute` (an import path) or `name` (an entry point in the `rollflow.envs` group).

# The built-in string tasks' arguments that older profiles set at the top level of an `[[envs]]` entry.
LEGACY_ARGS = ("min_chars", "max_chars", "lengths")
# The built-in string tasks' defaults (engines/environments/base.py's reverse_text and sort_letters): the config's
# length check and the resume comparison use them.
STRING_TASK_DEFAULTS = {"min_chars": 3, "max_chars": 8, "lengths": "uniform"}


def is_import_path(env_id: str) -> bool:
    return ":" in env_id


class EnvSpec(Strict):
    """One environment in the task mix; `id` names its factory (docs/environments.md)."""

    id: str = Field(
        "",  # filled from `name` when absent (_defaults)
        description="`module:attribute` (an import path) or an entry point name in the `rollflow.envs` group; "
        "default: `name`",
    )
    name: str = Field("", description="the label in the lake and metrics; default: `id`")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the factory")
    weight: float = Field(1.0, gt=0)
    prompt: Literal["auto", "tag", "instruct"] = Field(
        "auto",
        description="tag: `rev:abc` (the built-in model's format); instruct: a sentence for chat models; "
        "auto: what the tokenizer suits (tag for the character tokenizer, instruct for Hugging Face ones); "
        "passed as `prompt_style` to factories that take it",
    )
    advantage: AdvantageConfig | None = Field(
        None, description="this environment's advantage estimator; default: [orchestrator.advantage]"
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """`id` and `name` default to each other; `min_chars = 3` at the top level (older profiles) means
        `args.min_chars = 3`."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("id") is None and data.get("name") is None:
            raise ValueError("an [[envs]] entry needs `id` (an import path or entry point name) or `name`")
        data.setdefault("id", data.get("name"))
        data.setdefault("name", data["id"])
        if any(k in data for k in LEGACY_ARGS):
            args = dict(data.get("args") or {})
            for key in LEGACY_ARGS:
                if key in data:
                    if key in args:
                        raise ValueError(f"{key} is set both at the top level and in args; keep args.{key}")
                    args[key] = data.pop(key)
            data["args"] = args
        return data

    @field_validator("id")
    @classmethod
    def _id_syntax(cls, env_id: str) -> str:
        if is_plugin_name(env_id):
            return env_id
        raise ValueError(
            f"env id {env_id!r} is neither an import path `module:attribute` (e.g. 'my_pkg.envs:load') "
            f"nor an entry point name (e.g. {', '.join(repr(n) for n in sorted(ENVIRONMENTS))})"
        )

    @property
    def label(self) -> str:
        """The env's name in tasks, the lake's `env` column and metrics."""
        return self.name

    def max_payload_chars(self) -> int | None:
        """A built-in string task's longest payload (the config checks `model.max_seq_len` with it);
        None for other environments, whose prompt length is known only once they run."""
        if self.id not in STRING_TASKS:
            return None
        value = self.args.get("max_chars", STRING_TASK_DEFAULTS["max_chars"])
        return value if isinstance(value, int) else None


@dataclass(frozen=True)
class EnvFacts:
    """What loading measured of one built environment (engines/environments/loadcheck.py), for the run-level
    rules that join it with other sections (`RunConfig.env_problems`, config/run.py)."""

    where: str  # the entry as messages name it: "profile.toml: envs[0] (name 'x', id 'y')"
    prompts: int  # first-turn prompts measured
    longest_prompt: int  # the longest of them, in tokens of the run's tokenizer, through its chat template
    demonstrations: bool  # whether the SFT warm-up has reference answers to train on
    drawn: str  # what the run draws its tasks from, as the load report says it

    def report(self) -> str:
        return (
            f"{self.where}: {self.drawn}; {self.prompts} first-turn prompts measured, the longest "
            f"{self.longest_prompt} tokens; {'has' if self.demonstrations else 'no'} demonstrations"
        )
