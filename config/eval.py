"""The `[eval]` section: evaluation on the environments' held-out splits (`rollflow eval`, and during RL with
`interval > 0`). docs/evaluation.md has the metrics and where results go.

Checked here: the settings among themselves (greedy means one sample per task, every k of pass@k at most n, a
name that is one safe folder). Checked at load, with the environments built (rollflow/evalcmd.py `check_eval`): each
evaluated environment has a held-out split of at least `num_tasks` tasks, and `envs` names configured entries.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.model import ModelConfig

# One folder under OUTPUT_DIR/evals/: letters, digits and . _ - (no separators, no leading dot).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
ONLINE = "online"  # evals/online/version=V/: the evaluations the orchestrator runs during RL


class EvalConfig(Strict):
    """What to evaluate and how; the same settings serve `rollflow eval` and the evaluations during RL."""

    envs: list[str] | None = Field(None, description="the [[envs]] names to evaluate; default: every environment")
    num_tasks: int = Field(100, gt=0, description="held-out tasks per environment: eval_task(0..num_tasks-1)")
    n: int = Field(1, gt=0, description="samples per task")
    temperature: float = Field(0.0, ge=0, description="0: greedy (then n must be 1)")
    max_new_tokens: int | None = Field(None, gt=0, description="default: orchestrator.max_new_tokens")
    k: list[int] = Field(default_factory=lambda: [1], min_length=1, description="the k of pass@k, each <= n")
    correct_threshold: float = Field(1.0, description="a sample is correct when its reward >= this (pass@k)")
    block_tasks: int = Field(16, gt=0, description="tasks per committed chunk (what a killed evaluation redoes)")
    seed: int | None = Field(None, description="the sampling seed; default: the run's seed")
    name: str | None = Field(None, description="rollflow eval: the results folder evals/<name>; default: by target")
    output_dir: str | None = Field(
        None, description="rollflow eval: where evals/<name> goes; default: the --run directory, else output_dir"
    )
    interval: int = Field(0, ge=0, description="during RL: evaluate every this many policy versions; 0: never")
    requests_in_flight: int | None = Field(
        None, gt=0, description="rollflow eval: concurrent requests; default: orchestrator.requests_in_flight"
    )
    final_timeout_s: float = Field(
        600.0, gt=0, description="during RL: how long the orchestrator and trainer wait for the final version's eval"
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str | None) -> str | None:
        if name is not None and (not NAME_PATTERN.fullmatch(name) or name == ONLINE):
            raise ValueError(
                f"eval.name={name!r}: one folder name of letters, digits, '.', '_' or '-' (not starting with '.' "
                f"or '-', at most 100 characters), and not {ONLINE!r} (reserved for the evaluations during RL)"
            )
        return name

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if self.temperature == 0 and self.n != 1:
            raise ValueError(
                f"eval.temperature = 0 is greedy: every sample of a task would be the same; set eval.n = 1 "
                f"(got {self.n}) or eval.temperature > 0"
            )
        too_big = [k for k in self.k if not 1 <= k <= self.n]
        if too_big:
            raise ValueError(f"eval.k={self.k}: each k of pass@k must be in 1..eval.n={self.n}; {too_big} is not")
        if self.envs is not None and len(set(self.envs)) != len(self.envs):
            raise ValueError(f"eval.envs={self.envs} names an environment twice")
        return self


class EvalTarget(Strict):
    """What one `rollflow eval` evaluates and where its results go, as the CLI resolved it (rollflow/evalcmd.py)."""

    model: ModelConfig  # the served model's config: the run's stored one for --run
    run_dir: str | None = None  # serve publication `step` of this run; None: model.path's own weights (version 0)
    step: int | None = Field(None, ge=0)
    output_dir: str  # results go to <output_dir>/evals/<name>
    name: str
    describe: dict  # what the results record as their target (`_eval.json` "target")

    @property
    def version(self) -> int:
        return 0 if self.step is None else self.step
