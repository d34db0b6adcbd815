"""Request and response bodies of the inference HTTP API (OpenAI-compatible plus rollflow extensions).

They cross a process boundary (orchestrator or any OpenAI client -> server), so each is explicit.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from config.vllm import SESSION_HEADER as SESSION_HEADER  # re-exported for the engines

MAX_TOP_LOGPROBS = 20  # as vLLM's default --max-logprobs
# Bounds on a request's fields (docs/inference.md "Limits"): a request over one is a 400 before anything is
# allocated for it. They sit far above what rollflow's own clients send (the orchestrator: n = group_size).
MAX_N = 1024  # samples per request; the embedded engine also refuses n over its inference.max_batch_size
MAX_TOP_K = 2**31 - 1  # any value at or above the vocabulary size keeps every token
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256  # characters per stop string: the text held back while streaming is one shorter
MAX_MESSAGES = 1024  # chat messages per request
MAX_PROMPT_IDS = 2**20  # token ids in a prompt (the server then refuses what exceeds max_model_len)
# Temperatures under this sample greedily (as vLLM does): dividing by them overflows the logits to inf
GREEDY_BELOW = 1e-5
# Images in a prompt (engines/models/vision.py, which takes these bounds from here): at most MAX_IMAGES, each at
# most MAX_IMAGE_BYTES encoded, so at most MAX_IMAGE_BASE64 characters of base64 (checked before decoding)
MAX_IMAGES = 8
MAX_IMAGE_BYTES = 4 * 2**20
MAX_IMAGE_BASE64 = 4 * -(-MAX_IMAGE_BYTES // 3)
MAX_CONTENT_PARTS = 64  # OpenAI content parts per chat message
# an image part's URL: a data URL (the server fetches nothing) of base64 bytes
DATA_URL_PREFIXES = ("data:image/png;base64,", "data:image/jpeg;base64,")
MAX_IMAGE_URL = max(map(len, DATA_URL_PREFIXES)) + MAX_IMAGE_BASE64
# The admin routes' bearer token: the flow draws one per attempt and gives it to the inference process and
# the orchestrator through this environment variable (a process without it draws a random one).
ADMIN_TOKEN_ENV = "ROLLFLOW_ADMIN_TOKEN"
# The teacher server's token, as the orchestrator receives it (the teacher itself reads ADMIN_TOKEN_ENV).
TEACHER_TOKEN_ENV = "ROLLFLOW_TEACHER_TOKEN"


def identity_proof(token: str, nonce: str) -> str:
    """What GET /identity answers: proof that the server holds `token`, without revealing it. A client checks
    it before it sends the token or trusts the server's samples, since the port the flow chose may have been
    taken by another local process between the flow's probe and the server's bind."""
    return hmac.new(token.encode(), b"rollflow-identity:" + nonce.encode(), hashlib.sha256).hexdigest()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with `usage` and no choices before `data: [DONE]`


class SamplingFields(BaseModel):
    """Fields both generation routes take. Unknown fields are refused (400), never silently ignored, and the
    OpenAI fields rollflow does not implement are accepted only at their neutral value.

    Defaults are None where the field is optional, so a client's `model_dump(exclude_none=True)` (the
    orchestrator's) sends only what it set, to either backend.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None  # when given, the served model's name (GET /v1/models), else 404
    max_tokens: int | None = Field(None, gt=0)  # None: up to the model's max_model_len
    temperature: float = Field(1.0, ge=0)  # 0 (or under GREEDY_BELOW): greedy (the most likely token)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 or 0: no limit (vLLM's convention)
    min_tokens: int | None = Field(None, ge=0)  # vLLM extension: end-of-sequence is not drawn before this
    ignore_eos: bool | None = None  # vLLM extension: end-of-sequence does not end the completion
    # the text ends before the first of these; token_ids keep every token
    stop: str | list[str] | None = None
    n: int = Field(1, gt=0, le=MAX_N)
    seed: int | None = Field(None, ge=0)  # OpenAI field: same seed + prompt -> same samples, in any batch
    return_token_ids: bool = False  # vLLM extension: completion (and prompt) token ids
    # rollflow extension: per sampled token, the size of the support top-k / top-p truncation kept (`kept_sizes`);
    # None (not sent) or false: not returned. The vLLM backend does not return it (docs/algorithm.md)
    return_kept_sizes: bool | None = None
    # rollflow extension (MoE with inference.enable_return_routed_experts): each choice's `routed_experts`; not
    # sent or false: none (they are large: [seq, layers, top_k] per choice)
    return_routed_experts: bool | None = None
    stream: bool = False  # server-sent events, one chunk per token of a choice
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    frequency_penalty: float | None = None  # only 0
    presence_penalty: float | None = None  # only 0
    logit_bias: dict[str, float] | None = None  # only empty

    @model_validator(mode="after")
    def _neutral_only(self) -> SamplingFields:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by the embedded engine (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by the embedded engine (only empty)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        if len(self.stops()) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stops()):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        if self.return_kept_sizes and self.stream:
            raise ValueError("return_kept_sizes is not returned when streaming (stream=false)")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    # text (its length is bounded by the server's max_model_len, frontend.py), or token ids (token-in, as vLLM)
    prompt: str | Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the sampled token's logprob, and k alternatives
    # vLLM extension: per prompt token (the first has none: null), its logprob given the tokens before it, and k
    # alternatives; what a distillation teacher scores a student's samples with (docs/distillation.md)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # only false
    best_of: int | None = None  # only n (or unset)
    suffix: str | None = None  # only unset
    # rollflow extension (vision-language models): base64 of each image's PNG or JPEG bytes, in prompt order; the
    # prompt is token ids whose image token runs are already expanded, one per image (the server checks them)
    images: Annotated[list[Annotated[str, Field(max_length=MAX_IMAGE_BASE64)]], Field(max_length=MAX_IMAGES)] | None = (
        None
    )

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by the embedded engine")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by the embedded engine (only equal to n)")
        if self.suffix is not None:
            raise ValueError("suffix is not supported by the embedded engine")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is returned only without streaming (stream=false)")
        if self.images and isinstance(self.prompt, str):
            raise ValueError("images need a token-id prompt whose image placeholders are expanded (vision.py `expand`)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=MAX_IMAGE_URL)  # data:image/png;base64,... or data:image/jpeg;base64,...
    detail: Literal["auto"] | None = None  # OpenAI's field: only its default

    @field_validator("url")
    @classmethod
    def _data_url(cls, url: str) -> str:
        if not url.startswith(DATA_URL_PREFIXES):
            raise ValueError(f"an image URL must be a data URL starting with one of {', '.join(DATA_URL_PREFIXES)}")
        return url


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    # text, or OpenAI's content parts (text and images, a vision-language model's prompt); answers are text
    content: str | Annotated[list[ContentPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        """The message's text: its content, or its text parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[str]:
        """The base64 of each image part, in order."""
        if isinstance(self.content, str):
            return []
        return [p.image_url.url.split(",", 1)[1] for p in self.content if isinstance(p, ImagePart)]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per position (needs logprobs)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if len(self.images()) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images in one request")
        return self

    def images(self) -> list[str]:
        """The base64 of every image part, in message order."""
        return [image for m in self.messages for image in m.images()]


class UpdateWeightsRequest(BaseModel):
    """Name a committed publication by version (OUTPUT_DIR/weights/step=<version>/) or by path.

    The version the engine then reports is the one in the publication's manifest, never the caller's.
    """

    version: int | None = Field(None, ge=0)
    path: str | None = None
    # a shared deployment (docs/multitenant.md): the tenant whose adapter to update; only `version` then (the
    # publication is read from the tenant's own OUTPUT_DIR as its record names it, never from a path given here)
    tenant: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,31}$")

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
    workers: list[dict[str, Any]] | None = None  # what each worker reported (the vLLM backend's servers)


class IdentityResponse(BaseModel):
    proof: str  # identity_proof(admin token, nonce)


class HealthResponse(BaseModel):
    status: str
    policy_version: int
    stats: dict[str, int]
    # a shared deployment: each attached tenant's served adapter version (-1: registered, adapter not loaded yet)
    tenants: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int] | None = None
    top_logprobs: list[dict[str, float]] | None = None  # with logprobs >= 1: the k most likely, per position


class PromptLogprob(BaseModel):
    """A prompt position's entry, as vLLM's `Logprob`: keyed by the token id (as text) in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at this position
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    stop_reason: str | None = None  # the stop string that ended it (vLLM's field)
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (per choice, as vLLM places it)
    # rollflow extension: which weights produced the first and the last completion token
    policy_version: int
    policy_version_end: int
    # rollflow extension (inference.enable_return_routed_experts, MoE models): [seq, layers, top_k] expert ids
    # for every position the engine ran, seq = prompt + completion - 1 (docs/rollouts.md)
    routed_experts: list[list[list[int]]] | None = None
    # rollflow extension (return_kept_sizes): per completion token, how many tokens the sampler's truncated
    # distribution kept (top-k / top-p after temperature; the vocabulary size when nothing was cut)
    kept_sizes: list[int] | None = None
    # with prompt_logprobs (vLLM's shape): one entry per prompt token, null for the first; each maps token ids
    # (as text) to their logprob: the prompt's own token and the k most likely
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # with top_logprobs = k: the k most likely


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str
    stop_reason: str | None = None
    logprobs: ChatChoiceLogprobs | None = None
    token_ids: list[int] | None = None
    policy_version: int
    policy_version_end: int
    routed_experts: list[list[list[int]]] | None = None
    kept_sizes: list[int] | None = None  # as CompletionChoice's


class ChatResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids (top level, as vLLM places it for chat)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "rollflow"
    root: str
    max_model_len: int  # prompt + completion tokens the model takes (model.max_seq_len)


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str  # e.g. invalid_request_error, not_found_error, authentication_error
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error the servers return: OpenAI's shape, plus `detail` (the same message) for older clients."""

    error: ErrorBody
    detail: str
