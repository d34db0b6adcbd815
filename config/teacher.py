"""The `[teacher]` section: on-policy distillation (docs/distillation.md). Off unless `path` is set.

With a teacher the flow runs a second inference component, "teacher", which serves the model directory
`path` with its own `[teacher.inference]` backend settings and never receives weight updates. The orchestrator
asks it for the logprob of every sampled completion token (prompt-logprob scoring) and gives each token the
advantage `kl_coef * (teacher_logprob - sampler_logprob) + reward_coef * (the sample's environment advantage)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.base import Strict
from config.inference import InferenceConfig


class TeacherConfig(Strict):
    path: str | None = Field(
        None,
        description="the teacher: a Hugging Face model directory (a run's publication weights/step=N/ too), a "
        "name fetched by `rollflow models fetch`, or an org/name in the local Hugging Face cache; None: no teacher",
    )
    impl: Literal["auto", "custom", "hf"] = Field("auto", description="as model.impl, for the teacher")
    inference: InferenceConfig = Field(
        default_factory=InferenceConfig, description="the teacher's inference backend, its own port (0: a free one)"
    )
    kl_coef: float = Field(1.0, ge=0, description="weight of the per-token teacher_logprob - sampler_logprob")
    reward_coef: float = Field(
        0.0, ge=0, description="weight of the sample's environment advantage (0: pure distillation)"
    )
    center: bool = Field(
        False,
        description="subtract the step's mean teacher - sampler gap (-teacher_kl) from each token's: a baseline that "
        "lowers the variance of the teacher term without changing its expected gradient",
    )
    requests_in_flight: int = Field(16, gt=0, description="concurrent scoring requests to the teacher")
    timeout_s: float = Field(120.0, gt=0, description="bound on one scoring request (and the teacher's /health wait)")

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @model_validator(mode="after")
    def _some_signal(self) -> TeacherConfig:
        if self.enabled and self.kl_coef == 0 and self.reward_coef == 0:
            raise ValueError(
                "teacher.kl_coef = 0 and teacher.reward_coef = 0 give every token advantage 0: set kl_coef > 0 "
                "(distillation) and/or reward_coef > 0 (the environment's advantage)"
            )
        return self
