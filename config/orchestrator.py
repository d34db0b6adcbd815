"""The orchestrator's settings: batch shape, sampling, request concurrency, the advantage estimator and reward
shaping (config/advantage.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from config.advantage import AdvantageConfig, OverlongConfig, with_legacy_normalize
from config.base import Strict


class OrchestratorConfig(Strict):
    batch_size: int = Field(32, gt=0, description="prompts per step")
    group_size: int = Field(8, gt=1, description="samples per prompt (G)")
    max_new_tokens: int = Field(12, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: 1.0 = off (docs/algorithm.md)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens: 0 = off")
    requests_in_flight: int = Field(16, gt=0, description="concurrent group requests to inference")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="the advantage estimator")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO soft overlong punishment")
    max_inflight_groups: int = Field(
        0, ge=0, description="groups kept in flight across steps (long-horizon episodes); 0 = batch_size"
    )
    stale_turns: Literal["mask", "drop"] = Field(
        "mask", description="an episode whose oldest turn is over max_off_policy_steps: mask those turns, or drop it"
    )
    poll_interval_s: float = Field(
        0.01,
        gt=0,
        description="how often the weight follower reads whether the engine's next version is committed (one small "
        "read each; all of weights/ is listed once a second); on an object store each read is a request",
    )
    inference_timeout_s: float = Field(120.0, gt=0, description="how long to wait for the engine's /health")

    @model_validator(mode="before")
    @classmethod
    def _legacy_normalize(cls, data: Any) -> Any:
        return with_legacy_normalize(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _pool_fills_a_batch(self) -> OrchestratorConfig:
        if 0 < self.max_inflight_groups < self.batch_size:
            raise ValueError(
                f"orchestrator.max_inflight_groups={self.max_inflight_groups} is less than "
                f"orchestrator.batch_size={self.batch_size}: set it to 0 (= batch_size) or at least {self.batch_size}"
            )
        return self

    @property
    def inflight_groups(self) -> int:
        return self.max_inflight_groups or self.batch_size

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> OrchestratorConfig:
        if self.overlong.buffer >= self.max_new_tokens:
            raise ValueError(
                f"orchestrator.overlong.buffer={self.overlong.buffer} must be less than "
                f"orchestrator.max_new_tokens={self.max_new_tokens} (the penalty ramps up over the last `buffer`)"
            )
        return self
