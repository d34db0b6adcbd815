"""The `[inference]` section: which engine serves the run (`backend`), where, and its batch and precision.

The vLLM backend's keys (shape, parallelism, router, offload, flags, `[inference.vllm]`) are validated as
their own model, `VLLMConfig` (config/vllm.py), held in `inference.vllm`; the profile writes the shape keys
flat in `[inference]`, as the seed does (config/base.py's FLAT_KEYS reads and writes that layout).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from config.base import Strict
from config.registry import INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS, one_of
from config.vllm import SHAPE_KEYS, VLLMConfig, replay_without_offload

# The default token budget holds this many full batches of max_model_len-token rows (config/run.py raises it to the
# orchestrator's own load, requests_in_flight * group_size rows, where that is more)
QUEUED_BATCHES = 4
# backend "auto": vLLM CPU overtook the embedded engine between 12M and 76M parameters (docs/benchmarks.md,
# benchmark 8: engine / vLLM 1.17x at 12.1M, below 1 at 75.6M and 134.5M, one thread each)
AUTO_VLLM_MIN_PARAMS = 50_000_000


class InferenceConfig(Strict):
    """The settings every inference engine reads, and the vLLM backend's own in `vllm`."""

    FLAT_KEYS: ClassVar[dict[str, tuple[str, ...]]] = {"vllm": SHAPE_KEYS}

    backend: str = Field(
        "embedded",
        description="the inference engine; one of config/registry.py's INFERENCE_BACKENDS, or 'auto': vllm for a "
        "model of at least auto_vllm_min_params parameters when its environment exists and it runs the settings, "
        "else embedded (engines/inference/auto.py; resolved once at load and stored in the run's config)",
    )
    auto_vllm_min_params: int = Field(
        AUTO_VLLM_MIN_PARAMS, gt=0, description="backend 'auto': the model size from which vLLM serves the run"
    )
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: the flow picks a free port at launch
    max_batch_size: int = Field(256, gt=0)
    num_threads: int = Field(1, gt=0)
    onednn_linear: bool = Field(
        False,
        description="embedded engine: fp32 Linear layers through oneDNN on weights packed once (faster decode from "
        "~76M parameters on CPU; logprobs differ from MKL's by ~1e-6; engines/inference/embedded/packed.py)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="precision the engine runs the model in (the trainer's: trainer.compute_dtype, float32 by default)",
    )
    enable_return_routed_experts: bool = Field(
        False, description="MoE: return each token's routed expert ids (the `routed_experts` rollout column)"
    )
    # Admission (docs/inference.md "Limits"): what the server holds at once; one more request is a 429 with
    # Retry-After. A request's work is n * (prompt + max_tokens) tokens (max_model_len without max_tokens).
    max_queued_requests: int = Field(1024, gt=0, description="generation requests held at once (running or queued)")
    max_queued_tokens: int | None = Field(
        None,
        gt=0,
        description="tokens of work held at once; None: 4 * max_batch_size * the model's max_seq_len, or the "
        "orchestrator's load (requests_in_flight * group_size * max_seq_len) when more",
    )
    retry_after_s: int = Field(1, gt=0, description="the Retry-After of a 429 (queue or token budget full)")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="backend 'vllm' only (config/vllm.py)")
    _auto: bool = PrivateAttr(False)  # `backend` was "auto" and holds its choice (a --resume keeps the stored one)

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name == "auto":  # resolved at load (engines/inference/auto.py), before anything reads the backend
            return name
        return one_of("inference backend", name, INFERENCE_BACKENDS, INFERENCE_BACKEND_GROUP)

    def queued_tokens(self, max_model_len: int) -> int:
        """The token budget of a server whose model takes `max_model_len` tokens."""
        return self.max_queued_tokens or QUEUED_BATCHES * self.max_batch_size * max_model_len

    @model_validator(mode="after")
    def _vllm_keys_fit(self) -> InferenceConfig:
        replay_without_offload(self.enable_return_routed_experts, self.vllm)
        return self
