"""The orchestrator's settings: batch shape, sampling, request concurrency."""

from __future__ import annotations

from pydantic import Field

from config.base import Strict


class OrchestratorConfig(Strict):
    batch_size: int = Field(32, gt=0, description="prompts per step")
    group_size: int = Field(8, gt=1, description="samples per prompt (G)")
    max_new_tokens: int = Field(12, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: 1.0 = off (docs/algorithm.md)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens: 0 = off")
    requests_in_flight: int = Field(16, gt=0, description="concurrent group requests to inference")
    normalize_advantages: bool = Field(True, description="divide group-centred rewards by the group std")
    poll_interval_s: float = Field(0.05, gt=0)
    inference_timeout_s: float = Field(120.0, gt=0, description="how long to wait for the engine's /health")
