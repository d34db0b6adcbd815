"""What an inference backend is: the interface the HTTP front end serves, and the declaration a backend registers.

A backend is registered under a name (config/registry.py `INFERENCE_BACKENDS`, or the entry-point group
`rollflow.inference_backends` of any installed package) that points at a `BackendSpec`: its `Capabilities`
and the import path of the factory that builds it. The spec's module must stay import-light (no torch,
no fastapi), because the CLI loads it at load time to refuse settings the backend cannot run (`check`).

    rollflow rl ... -> check(run's inference settings, the spec's capabilities)   exit 2 with a message
    python -m engines.inference --config inference.json (engines/inference/server.py)
        -> spec.create(cfg) -> a `Backend` -> the front end (engines/inference/frontend.py) serves it

The front end owns HTTP (routes, validation, OpenAI-shaped errors, admin auth, streaming framing, abort on
disconnect, request bounds); a backend turns a checked `Generation` into a response body or into stream
chunks, applies weight updates, and reports its health.
"""

from __future__ import annotations

import abc
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from config.registry import INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS, registered
from config.vllm import SHAPE_KEYS
from engines import protocol as api
from engines import registry
from engines.registry import PluginError

if TYPE_CHECKING:
    from config.inference import InferenceConfig
    from config.orchestrator import OrchestratorConfig
    from config.process import InferenceProcessConfig
    from config.trainer import TrainerConfig
    from config.transport import WeightBroadcastConfig
    from engines.models.vision import VisionSpec

# The `[inference]` keys that shape a deployment of servers (config/vllm.py's SHAPE_KEYS; replicas are their
# own capability); a backend runs those it lists in `Capabilities.deployment_keys`, any other one set is refused.
DEPLOYMENT_KEYS = tuple(key for key in SHAPE_KEYS if key != "num_infer_replicas")
VISION_NEED = "a vision-language model (its config.json has vision_config) needs a backend that serves images"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run; the load-time check refuses a run that asks for more."""

    replicas: bool = False  # several copies, each behind a router (inference.num_infer_replicas > 1)
    collective_weights: bool = False  # joins the trainer's collective group (weight_broadcast.type = "collective")
    routed_experts: bool = False  # returns `routed_experts` (inference.enable_return_routed_experts, MoE replay)
    deployment_keys: frozenset[str] = frozenset()  # which of DEPLOYMENT_KEYS it runs
    # returns `kept_sizes` (return_kept_sizes): the support its top-k / top-p truncation kept per token, which
    # the trainer scores on (trainer.keep_sampling_mask, docs/algorithm.md "Keep sampling mask")
    kept_support: bool = False
    # serves vision-language models: prompts with images (`images` on /v1/completions, engines/models/vision.py)
    vision: bool = False
    # why it does not, when it does not: the load-time check's message for a vision-language model
    no_vision_reason: str = ""
    # serves a shared deployment's tenants, each with its own LoRA adapter (InferenceProcessConfig.shared,
    # docs/multitenant.md); `no_shared_reason`: why not, the message of its refusal at load
    shared: bool = False
    no_shared_reason: str = ""
    # `module:attribute` of (RunConfig) -> {file name: text}: what `--dry-run` and every attempt write to
    # OUTPUT_DIR/config/ besides the component configs (e.g. the vLLM commands); None: nothing
    launch_plan: str | None = None


@dataclass(frozen=True)
class BackendSpec:
    """A backend's registration: its capabilities and `create`, the `module:attribute` of a factory
    `(InferenceProcessConfig) -> Backend` (or an async one), imported only in the inference process."""

    capabilities: Capabilities
    create: str


class BackendError(Exception):
    """A request or update the backend refuses: `status` is the HTTP status the front end answers with
    (OpenAI's error shape), `message` says what was wrong and what would be valid."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Generation:
    """A generation request the front end has checked: the typed body (unknown fields and unsupported
    values are refused already, and `model`, when given, is the served name)."""

    body: api.CompletionRequest | api.ChatRequest
    session: str | None = None  # the value of the configured session header (inference.router.session_header)
    request_id: str | None = None  # the client's X-Request-Id, else <session>-<hex> for a session
    headers: dict[str, str] = field(default_factory=dict)  # the client's other x- headers, lower-cased
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the response's id (cmpl-<id>, chatcmpl-<id>)
    # the request's images (bytes, in prompt order), decoded and checked against the model by the front end
    images: tuple[bytes, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    tenant: str | None = None  # a shared server: the tenant the request's `model` named and its token proved

    @property
    def chat(self) -> bool:
        return isinstance(self.body, api.ChatRequest)


# A response body: the protocol's model, or its JSON (a backend relaying an OpenAI-compatible server
# returns that server's body with rollflow's fields added).
Body = api.CompletionResponse | api.ChatResponse | dict[str, Any]


class TenantAuth(Protocol):
    """A shared server's gate (docs/multitenant.md): which tenant a request is for."""

    def authorize(self, model: str | None, authorization: str | None) -> str:
        """The tenant `model` names when `authorization` (the request's Authorization header) carries its token;
        BackendError 404 (no such tenant), 401 (missing or wrong token), 403 (the tenant was refused)."""
        ...


class Backend(abc.ABC):
    """The engine behind the front end. Generation runs under asyncio cancellation: when the client goes
    away the front end cancels `generate`, or stops iterating `stream`, and the backend stops the work."""

    model_name: str  # the served name (GET /v1/models); a request naming another is a 404
    max_model_len: int  # prompt + completion tokens
    # the served model's image token layout when it is a vision-language model; None: text only (the front end
    # refuses a request with images)
    vision_spec: VisionSpec | None = None
    # a shared server's tenant gate: generation and /update_weights then need a tenant's token (no admin token)
    tenant_auth: TenantAuth | None = None

    @abc.abstractmethod
    async def generate(self, gen: Generation) -> Body:
        """The whole answer; BackendError for a request it cannot run."""

    @abc.abstractmethod
    def stream(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        """The answer as OpenAI stream chunks (`text_completion` or `chat.completion.chunk` objects, the
        usage chunk included when asked for); the front end frames them and ends with `[DONE]`. A
        BackendError before the first chunk is answered with its status."""

    @abc.abstractmethod
    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        """Serve the publication `req` names; BackendError 404 (none there), 409 (older than served),
        422 (corrupted or not this model)."""

    @abc.abstractmethod
    async def health(self) -> api.HealthResponse:
        """The served policy version and counters; BackendError 503 when it cannot serve."""

    async def watch(self) -> None:
        """Return (or raise) when the backend can no longer serve, e.g. a process it runs has exited: the
        front end then stops and the process exits non-zero. The default never returns."""
        import asyncio

        await asyncio.Event().wait()

    async def close(self) -> None:  # noqa: B027 - an optional hook
        """Release what the backend holds (threads, processes, connections)."""


def served_name(cfg: InferenceProcessConfig) -> str:
    """The model name every backend serves a run under (GET /v1/models, a request's `model`)."""
    return f"rollflow/{cfg.run.run_id}"


def spec(name: str) -> BackendSpec:
    """The registered backend `name` (or an import path `module:attribute`), checked to be a BackendSpec."""
    found = registry.load("inference backend", name, INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS)
    if not isinstance(found, BackendSpec):
        raise PluginError(
            f"inference backend {name!r} names a {type(found).__name__}, not an engines.inference.backend.BackendSpec"
        )
    return found


def needs(
    inference: InferenceConfig,
    broadcast: WeightBroadcastConfig,
    orchestrator: OrchestratorConfig | None = None,
    trainer: TrainerConfig | None = None,
    vision: bool = False,
) -> list[tuple[str, Callable[[Capabilities], bool]]]:
    """Each capability the run's settings need: what needs it (naming the key), and whether a backend has it.
    `vision`: the model is a vision-language model (its config.json has vision_config)."""
    found: list[tuple[str, Callable[[Capabilities], bool]]] = []
    if vision:
        found.append((VISION_NEED, lambda c: c.vision))
    truncates = orchestrator is not None and (orchestrator.top_p < 1 or orchestrator.top_k > 0)
    if truncates and orchestrator is not None and (trainer is None or trainer.keep_sampling_mask):
        what = (
            f"orchestrator.top_p = {orchestrator.top_p} / top_k = {orchestrator.top_k} with "
            "trainer.keep_sampling_mask = true needs a backend that records the support its truncation kept "
            "per token (the trainer scores each token on it; without it the importance ratio is biased). "
            "--trainer.keep_sampling_mask false accepts the biased ratio (full-vocabulary logprobs)"
        )
        found.append((what, lambda c: c.kept_support))
    vllm = inference.vllm
    if vllm.num_infer_replicas > 1:
        what = f"inference.num_infer_replicas (or deployment.num_infer_replicas) = {vllm.num_infer_replicas}"
        found.append((f"{what} needs a backend that runs replicas behind routers", lambda c: c.replicas))
    if broadcast.type == "collective":
        what = 'weight_broadcast.type = "collective" needs a backend that joins the trainer\'s collective group'
        found.append((f'{what} (or use weight_broadcast.type = "filesystem")', lambda c: c.collective_weights))
    if inference.enable_return_routed_experts:
        what = "inference.enable_return_routed_experts (router replay; trainer.enable_router_replay turns it on)"
        found.append((f"{what} needs a backend that returns routed experts", lambda c: c.routed_experts))
    fields = type(vllm).model_fields
    for key in DEPLOYMENT_KEYS:
        if getattr(vllm, key) != fields[key].get_default(call_default_factory=True):
            found.append((f"inference.{key} is a deployment key", _runs(key)))
    return found


def _why_not(caps: Capabilities, what: str) -> str:
    return f" ({caps.no_vision_reason})" if what == VISION_NEED and caps.no_vision_reason else ""


def _runs(key: str) -> Callable[[Capabilities], bool]:
    return lambda c: key in c.deployment_keys


def _others(name: str) -> dict[str, Capabilities]:
    """The capabilities of every other registered backend whose declaration loads."""
    caps = {}
    for other in sorted(registered(INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS)):
        try:
            caps[other] = spec(other).capabilities
        except PluginError:
            continue
    caps.pop(name, None)
    return caps


def check(
    inference: InferenceConfig,
    broadcast: WeightBroadcastConfig,
    orchestrator: OrchestratorConfig | None = None,
    trainer: TrainerConfig | None = None,
    vision: bool = False,
) -> None:
    """Load the run's backend declaration and refuse (PluginError, one line per setting) what it cannot run,
    naming the registered backends that can. The orchestrator's sampling and the trainer's settings are checked
    when given (the CLI gives them; the inference process has neither); `vision`: the model is a VLM."""
    name = inference.backend
    caps = spec(name).capabilities
    wanted = needs(inference, broadcast, orchestrator, trainer, vision)
    missing = [(what, has) for what, has in wanted if not has(caps)]
    if not missing:
        return
    others = _others(name)
    lines = [
        f"{what}: inference.backend = {name!r} does not run it"
        f"{_why_not(caps, what)} (registered backends that do: "
        f"{', '.join(n for n, c in others.items() if has(c)) or 'none'})"
        for what, has in missing
    ]
    raise PluginError("the inference backend cannot run these settings:\n  " + "\n  ".join(lines))


def check_shared(name: str) -> None:
    """Refuse (PluginError) a shared deployment's server on a backend that cannot serve tenants' adapters."""
    caps = spec(name).capabilities
    if not caps.shared:
        why = f" ({caps.no_shared_reason})" if caps.no_shared_reason else ""
        others = ", ".join(n for n, c in _others(name).items() if c.shared) or "none"
        raise PluginError(
            f"a shared deployment (tenants' LoRA adapters): inference.backend = {name!r} does not serve it{why} "
            f"(registered backends that do: {others})"
        )


def launch_plan(cfg: Any) -> dict[str, str]:
    """The files the run's backend renders for OUTPUT_DIR/config/ (its `launch_plan`), else none."""
    path = spec(cfg.inference.backend).capabilities.launch_plan
    return registry.import_object(path)(cfg) if path else {}


def teacher_plan(cfg: Any) -> dict[str, str]:
    """The teacher's backend's launch plan (a `[teacher]` run), its files named `teacher-...`."""
    if not cfg.teacher.enabled:
        return {}
    longer = cfg.model.model_copy(update={"max_seq_len": cfg.model.max_seq_len + 1})  # as config/process.py's
    as_policy = cfg.model_copy(update={"inference": cfg.teacher.inference, "model": longer})
    return {f"teacher-{name}": text for name, text in launch_plan(as_policy).items()}


async def create(cfg: InferenceProcessConfig) -> Backend:
    """Build the configured backend (its heavy imports happen here, in the inference process)."""
    factory = registry.import_object(spec(cfg.inference.backend).create)
    backend = factory(cfg)
    if inspect.isawaitable(backend):  # the factory may be async (it may start processes and wait for them)
        backend = await backend
    if not isinstance(backend, Backend):
        raise PluginError(f"{factory!r} returned a {type(backend).__name__}, not an engines.inference.backend.Backend")
    return backend
