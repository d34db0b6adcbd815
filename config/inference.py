"""The inference server's settings (backend, address, batch); vLLM's deployment keys come from ServingFields."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from config.inference_deployment import ServingFields
from config.registry import INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS, one_of


class InferenceConfig(ServingFields):
    """The engine's settings; the deployment keys (shape, parallelism, router, ...): config/inference_deployment.py."""

    backend: str = Field("embedded", description="the inference engine; one of config/registry.py's INFERENCE_BACKENDS")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: the flow picks a free port at launch
    max_batch_size: int = Field(256, gt=0)
    num_threads: int = Field(1, gt=0)
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="precision the engine runs the model in (the trainer stays float32)"
    )
    enable_return_routed_experts: bool = Field(
        False, description="MoE: return each token's routed expert ids (the `routed_experts` rollout column)"
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of("inference backend", name, INFERENCE_BACKENDS, INFERENCE_BACKEND_GROUP)
