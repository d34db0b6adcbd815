"""Request and response bodies of the inference HTTP API (OpenAI-compatible plus rollflow extensions).

They cross a process boundary (orchestrator or any OpenAI client -> server), so each is explicit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: str | list[int]  # text, or token ids (token-in, as vLLM accepts)
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    n: int = Field(1, gt=0)
    logprobs: int | None = None  # any value returns the sampled token's logprob per position
    return_token_ids: bool = False  # vLLM extension: completion token ids (needed to train on them)
    seed: int | None = Field(None, ge=0)  # OpenAI field: same seed + prompt -> same samples, in any batch


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, gt=0)
    n: int = Field(1, gt=0)
    logprobs: bool = False
    return_token_ids: bool = False
    seed: int | None = Field(None, ge=0)


class UpdateWeightsRequest(BaseModel):
    """Name a committed publication by version (OUTPUT_DIR/weights/step=<version>/) or by path.

    The version the engine then reports is the one in the publication's manifest, never the caller's.
    """

    version: int | None = Field(None, ge=0)
    path: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> UpdateWeightsRequest:
        if (self.version is None) == (self.path is None):
            raise ValueError("give exactly one of 'version' or 'path'")
        return self


class UpdateWeightsResponse(BaseModel):
    policy_version: int  # the version served after the update
    load_s: float
    apply_s: float
    # where the tensors came from: the publication's files, or the trainer's collective group (weight_broadcast)
    source: Literal["filesystem", "collective"] = "filesystem"


class HealthResponse(BaseModel):
    status: str
    policy_version: int
    stats: dict[str, int]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    # rollflow extension: which weights produced the first and the last completion token
    policy_version: int
    policy_version_end: int
    # rollflow extension (inference.enable_return_routed_experts, MoE models): [seq, layers, top_k] expert ids
    # for every position the engine ran, seq = prompt + completion - 1 (docs/rollouts.md)
    routed_experts: list[list[list[int]]] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatLogprob(BaseModel):
    token: str
    logprob: float


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    policy_version: int
    policy_version_end: int
    routed_experts: list[list[list[int]]] | None = None


class ChatResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def admin_auth(token: str):
    """The FastAPI dependency of every admin route (weight updates, shutdown), for both backends' servers:
    `Authorization: Bearer <token>` or 401."""
    import secrets

    from fastapi import Header, HTTPException

    def check(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not secrets.compare_digest(authorization, f"Bearer {token}"):
            raise HTTPException(status_code=401, detail="admin route: missing or wrong bearer token")

    return check
