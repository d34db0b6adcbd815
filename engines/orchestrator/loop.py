"""Entry module of the orchestrator process: `python -m engines.orchestrator --config orchestrator.json`.

Per step N not yet committed: wait until the engine serves a policy no older than N-1-async_level, draw `batch_size`
prompts (a pure function of seed and step), request `group_size` samples each over HTTP, score them,
shape the rewards (DAPO overlong punishment, engines/orchestrator/overlong.py) and compute the step's advantages
once every group is in (here, for every environment kind: environments return scored rows; each env's groups by
its configured estimator, engines/orchestrator/estimators.py), apply the staleness rule (drop samples older than
`max_off_policy_steps`; mask an episode's stale turns, engines/orchestrator/admission.py), and commit
`rollouts/step=N/`. A background task follows `weights/` and pushes each new publication to the engine
while generation runs, so one rollout may span two policy versions. Requests and responses are the
inference API's own types (engines/protocol.py); each sample becomes a typed `RolloutRow`, carrying
the engine's `routed_experts`, which it asks for (`return_routed_experts`) with
inference.enable_return_routed_experts (MoE).
Multi-turn environments run `group_size` episodes per prompt instead (engines/orchestrator/multiturn.py),
and an environment that runs its own episodes (verifiers) samples through the same `EpisodeGroup`;
a step's episodes are committed together with its other samples, so an episode is in the lake whole or not
at all. Groups run in a pool (engines/orchestrator/pool.py): with orchestrator.max_inflight_groups above batch_size
a step takes the first groups to finish and the others carry over, mid-episode, to later steps, and the
staleness rule (engines/orchestrator/admission.py) masks or drops the turns of a taken episode that outlived
max_off_policy_steps; without, every step waits for its own groups, as a batch.
Every request names its session in the configured session header (inference.router.session_header,
`X-Session-ID` by default; one session per group, one per episode for multi-turn environments), which keeps
a session's turns on the replica that holds its KV cache.
With a `[teacher]` each group's samples are also scored by the teacher's server and every token gets its own
advantage (engines/orchestrator/teacher.py: the `teacher_logprobs` and `token_advantages` columns).
As a tenant of a shared deployment (`tenant` set; engines/orchestrator/tenant.py, docs/multitenant.md) every
request names the tenant as its `model` with the tenant's bearer token, and the weight sync follows the tenant's
own version on the shared server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import sys
import time
from collections import Counter

import httpx

from config.process import EXIT_REFUSED, OrchestratorProcessConfig
from engines.entry import read_process_config
from engines.environments import multimodal
from engines.environments.base import EnvironmentRefused, EnvMix, Task
from engines.environments.episodes import GroupEnvironment, MultiTurnEnvironment, is_multi_turn
from engines.heartbeat import heartbeat
from engines.models import modeldir
from engines.orchestrator import http_client
from engines.orchestrator.admission import admit
from engines.orchestrator.estimators import StepEstimators
from engines.orchestrator.multiturn import EpisodeGroup, post_completion, truncation
from engines.orchestrator.online_eval import OnlineEval
from engines.orchestrator.overlong import shaped_rewards
from engines.orchestrator.pool import GroupPool
from engines.orchestrator.prompts import Prompt, Prompts
from engines.orchestrator.teacher import Teacher, check_tokenizer
from engines.orchestrator.tenant import TenantClient, tenant_token, tenant_version, wait_registered
from engines.protocol import (
    ADMIN_TOKEN_ENV,
    TEACHER_TOKEN_ENV,
    CompletionChoice,
    CompletionRequest,
    HealthResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    identity_proof,
)
from engines.seeds import derive_seed
from storage import rollouts, weights
from storage.fs import Storage, is_local, read_manifest
from storage.rollouts import RolloutRow

log = logging.getLogger("rollflow.orchestrator")
LIST_EVERY_S = 1.0  # the weight follower's listing of weights/; between listings it reads one manifest per poll


class WeightSync:
    """Tracks the engine's policy version and pushes newer publications to it.

    `hold`, when set (online evaluation, engines/orchestrator/online_eval.py), is a version the engine does not
    move past: every sample of that evaluation comes from that one policy."""

    def __init__(self, client: httpx.AsyncClient, fs, root: str, token: str, poll_s: float, tenant: str | None = None):
        self.client, self.poll_s, self.tenant = client, poll_s, tenant  # tenant: a shared server's tenant
        self.fs, self.root = fs, root
        self.headers = {"Authorization": f"Bearer {token}"}
        self.engine_version = -1
        self.hold: int | None = None
        self.changed = asyncio.Event()
        self.follower: asyncio.Task

    async def refresh(self) -> None:
        r = await self.client.get("/health")
        r.raise_for_status()
        health = HealthResponse.model_validate_json(r.content)
        if self.tenant is None:
            self.engine_version = health.policy_version
        else:  # the tenant's own adapter version on the shared server
            self.engine_version = -1 if (v := tenant_version(health, self.tenant)) is None else v

    async def push_latest(self) -> None:
        latest = await asyncio.to_thread(self.target)
        if latest is not None and latest > self.engine_version:
            body = UpdateWeightsRequest(version=latest, tenant=self.tenant).model_dump(exclude_none=True)
            # the step waiting for this version waits on this request now, not on the trainer
            with heartbeat().waiting_on("inference", f"updating the engine to version {latest}", priority=1):
                r = await self.client.post("/update_weights", json=body, headers=self.headers)
            r.raise_for_status()
            resp = UpdateWeightsResponse.model_validate_json(r.content)
            self.engine_version = resp.policy_version
            log.info(f"engine now serves policy version {self.engine_version} (from {resp.source}, {resp.load_s:.3f}s)")
            self.changed.set()

    def target(self) -> int | None:
        """The newest committed publication; under a hold, the newest at or below it, unless the held version's
        own publication is gone while newer ones exist (a rollback): then the hold cannot be met and is ignored."""
        newest = weights.latest_version(self.fs, self.root)
        if self.hold is None or newest is None or newest <= self.hold:
            return newest
        return self.hold if weights.is_published(self.fs, self.root, self.hold) else newest

    async def follow(self) -> None:
        listed = -LIST_EVERY_S
        local = is_local(self.fs)  # a local read takes microseconds: not worth a thread hand-off 100 times a second
        while True:
            now = time.monotonic()
            if now - listed >= LIST_EVERY_S or (
                self.next_published() if local else await asyncio.to_thread(self.next_published)
            ):
                listed = now
                await self.push_latest()
            await asyncio.sleep(self.poll_s)

    def next_published(self) -> bool:
        """Whether the version after the engine's is committed and not held back: one small read. The trainer
        publishes consecutive versions, so this is how a new one shows; the listing every LIST_EVERY_S finds any
        other (a resumed trainer's first)."""
        version = self.engine_version + 1
        return (self.hold is None or version <= self.hold) and weights.is_published(self.fs, self.root, version)

    def start(self) -> None:
        self.follower = asyncio.create_task(self.follow())

    async def wait_for(self, version: int) -> float:
        """Block until the engine serves `version` or newer; returns seconds waited.

        Waits on the follower too: if it dies (engine refused an update, storage error), its error
        surfaces here instead of the orchestrator waiting forever for a version that never comes.
        """
        t0 = time.perf_counter()
        while self.engine_version < version:
            self.changed.clear()
            changed = asyncio.create_task(self.changed.wait())
            await asyncio.wait({changed, self.follower}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if self.follower.done():
                self.follower.result()
                raise RuntimeError("weight follower stopped")
        return time.perf_counter() - t0


def _required(value, name: str):
    """A response field the orchestrator asked for (return_token_ids, logprobs); its absence is a server bug."""
    if value is None:
        raise RuntimeError(f"inference response lacks '{name}', which the request asked for")
    return value


async def wait_healthy(client: httpx.AsyncClient, timeout_s: float = 120.0, token: str = "") -> None:
    """Until the server answers /health; then, given its admin token, check the server holds it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"inference server at {client.base_url} not healthy after {timeout_s}s")
        await asyncio.sleep(0.2)
    if token:
        await verify_identity(client, token)


async def verify_identity(client: httpx.AsyncClient, token: str) -> None:
    """Refuse a server that cannot prove it holds `token` (engines/protocol.py identity_proof): another local
    process that took the port before the server bound it gets neither the token nor the run's requests."""
    nonce = secrets.token_hex(16)
    r = await client.get("/identity", params={"nonce": nonce})
    proof = r.json().get("proof", "") if r.status_code == 200 else ""
    if not hmac.compare_digest(str(proof), identity_proof(token, nonce)):
        raise RuntimeError(
            f"the server at {client.base_url} does not hold this attempt's admin token (HTTP {r.status_code}): "
            "another process holds the port; the attempt restarts on a new one"
        )


class Orchestrator:
    def __init__(
        self,
        cfg: OrchestratorProcessConfig,
        client: httpx.AsyncClient,
        sync: WeightSync,
        teacher: Teacher | None = None,
    ):
        self.cfg, self.client, self.sync, self.teacher = cfg, client, sync, teacher
        self.fs, self.root = sync.fs, sync.root
        self.ocfg = cfg.orchestrator
        self.tok = modeldir.load_tokenizer(modeldir.resolve(cfg.model))
        self.prompts = Prompts(self.tok, cfg.model.max_seq_len, self.ocfg.max_new_tokens)
        self.mix = EnvMix(cfg.envs, cfg.seed, self.tok.prompt_style)
        self.limit = asyncio.Semaphore(self.ocfg.requests_in_flight)
        self.episodes = EpisodeGroup(
            client, self.limit, self.tok, self.ocfg, cfg.seed, cfg.model.max_seq_len, cfg.session_header
        )
        self.estimators = StepEstimators(self.ocfg.advantage, cfg.envs)
        self.pool = GroupPool(self.group, self.ocfg.inflight_groups, self.ocfg.batch_size)

    def set_advantages(self, groups: list[list[RolloutRow]]) -> dict[str, int]:
        """Every row's advantage from its group's (shaped) rewards, by its env's estimator, for the whole step;
        returns the counts the step's manifest records."""
        rewards, skipped = shaped_rewards(groups, self.ocfg.overlong, self.ocfg.max_new_tokens)
        zero = self.estimators.apply(groups, rewards)
        return {"zero_advantage_groups": zero, **({"overlong_skipped": skipped} if skipped else {})}

    async def group(self, step: int, group: int) -> list[RolloutRow]:
        """A scored group, and with a teacher its samples' teacher logprobs."""
        rows = await self.scored_group(step, group)
        if self.teacher is not None:
            await self.teacher.score(rows)
        heartbeat().advance()
        return rows

    async def scored_group(self, step: int, group: int) -> list[RolloutRow]:
        task = self.mix.task(f"step={step}/group={group}")
        env = self.mix.envs[task.env]
        if (isinstance(env, GroupEnvironment) or is_multi_turn(env)) and multimodal.images_of(task):
            raise EnvironmentRefused(f"environment {task.env!r}: images in multi-turn episodes are not supported")
        if isinstance(env, GroupEnvironment):  # it runs its own episodes (engines/environments/verifiers_env.py)
            return await env.run_group(self.episodes, task, self.cfg.run.run_id, step, group)
        if is_multi_turn(env):
            assert isinstance(env, MultiTurnEnvironment)
            return await self.episodes.run(env, task, self.cfg.run.run_id, step, group)
        prompt = self.prompts.render(task, self.ocfg.group_size)
        if prompt is None:  # dropped, and counted (prompts.py): the pool draws another group in its place
            return []
        request = CompletionRequest(
            prompt=prompt.ids,
            **prompt.request_fields(),  # the images, base64, in prompt order
            n=self.ocfg.group_size,
            max_tokens=self.ocfg.max_new_tokens,
            temperature=self.ocfg.temperature,
            logprobs=1,
            return_token_ids=True,
            # a pure function of (seed, step, group): a resumed run redraws exactly these samples
            seed=derive_seed(self.cfg.seed, step, group),
            **truncation(self.ocfg),  # orchestrator.top_p / top_k, and the kept support sizes with them
            return_routed_experts=self.cfg.routed_experts or None,  # the server sends them only when asked
        )
        group_id = rollouts.group_id(step, group)
        response = await post_completion(self.client, self.limit, request, group_id, self.cfg.session_header)
        return self.score_group(group_id, step, task, prompt, response.choices)

    def score_group(
        self, group_id: str, step: int, task: Task, prompt: Prompt, choices: list[CompletionChoice]
    ) -> list[RolloutRow]:
        rewards = [self.mix.reward(task, c.text) for c in choices]
        images = list(prompt.images) or None
        digests = rollouts.image_digests(prompt.images) or None
        return [
            RolloutRow(
                run_id=self.cfg.run.run_id,
                step=step,
                sample_id=rollouts.sample_id(group_id, k),
                group_id=group_id,
                env=task.env,
                policy_version=c.policy_version,
                policy_version_end=c.policy_version_end,
                prompt_ids=prompt.ids,
                completion_ids=_required(c.token_ids, "token_ids"),
                completion_logprobs=_required(c.logprobs, "logprobs").token_logprobs,
                reward=reward,
                temperature=self.ocfg.temperature,
                finish_reason=c.finish_reason,
                prompt_text=task.prompt,
                completion_text=c.text,
                routed_experts=c.routed_experts,
                completion_kept=c.kept_sizes,  # null without truncation (or from a backend that cannot say)
                images=images,
                image_sha256=digests,
            )
            for k, (c, reward) in enumerate(zip(choices, rewards, strict=True))
        ]

    async def run_step(self, step: int) -> None:
        version = step - 1 - self.cfg.async_level
        with heartbeat().waiting_on("trainer", f"waiting for policy version {version}"):
            waited = await self.sync.wait_for(version)
        t0 = time.perf_counter()
        bound, mode = self.cfg.max_off_policy_steps, self.ocfg.stale_turns
        with heartbeat().waiting_on("inference", f"generating step {step}"):
            dispatched = self.pool.top_up(step)
            taken = await self.pool.take(step, lambda rows: bool(admit(rows, step, bound, mode)[0]))
        gen_s = time.perf_counter() - t0
        # a group carried over from an earlier step is consumed by this one
        groups = [
            [r.model_copy(update={"step": step}) if r.step != step else r for r in g] for g in taken.groups.values()
        ]
        counts: dict = self.set_advantages(groups)  # before the staleness rule: over whole groups
        counts |= self.prompts.take_counts()  # prompts with images dropped before any request (prompts.py)
        rows = [row for grp in groups for row in grp]
        if self.teacher is not None:
            counts["teacher_kl"] = self.teacher.set_advantages(rows)
        kept, admission = admit(rows, step, bound, mode)
        if not kept:
            raise RuntimeError(f"step {step}: every sample exceeded max_off_policy_steps; nothing to commit")
        versions = Counter(r.policy_version for r in kept)
        meta = {"gen_s": gen_s, "wait_s": waited, "versions": dict(versions)} | admission.meta() | counts
        if self.ocfg.inflight_groups > self.ocfg.batch_size:  # what a resume needs (engines/orchestrator/pool.py)
            meta |= {"groups": list(taken.groups), "dispatched": dispatched + taken.dispatched}
            meta |= {"aged_out": taken.aged_out, "inflight": self.pool.inflight()}
        await asyncio.to_thread(rollouts.write_step, self.fs, self.root, step, rollouts.to_table(kept), meta)
        heartbeat().advance(f"committed step {step}")
        reward = sum(r.reward for r in kept) / len(kept)
        log.info(
            f"step {step}/{self.cfg.max_steps}: {len(kept)} samples (dropped {meta['dropped']}, "
            f"turns masked {admission.masked_turns}), reward {reward:.3f}, "
            + (f"teacher_kl {counts['teacher_kl']:.4f}, " if counts.get("teacher_kl") is not None else "")
            + f"zero-advantage groups {counts['zero_advantage_groups']}/{len(groups)}, "
            + "".join(f"{k} {counts[k]}, " for k in ("overflow_dropped", "image_refused") if counts.get(k))
            + f"policy versions {dict(sorted(versions.items()))}, "
            f"gen {gen_s:.2f}s, waited {waited:.2f}s"
        )

    def restore_pool(self) -> None:
        """Re-dispatch the groups the last committed step left in flight (none without carry-over)."""
        done = rollouts.committed_rollout_steps(self.fs, self.root)
        if done and self.ocfg.inflight_groups > self.ocfg.batch_size:
            manifest = read_manifest(self.fs, rollouts.step_path(self.root, done[-1]))
            self.pool.restore(manifest.get("inflight", []))

    def pending_steps(self) -> list[int]:
        """Steps not yet committed, in order; after a resume this includes any step removed as corrupt."""
        done = set(rollouts.committed_rollout_steps(self.fs, self.root))
        return [s for s in range(1, self.cfg.max_steps + 1) if s not in done]


async def run(cfg: OrchestratorProcessConfig) -> None:
    token = tenant_token() if cfg.tenant is not None else os.environ.get(ADMIN_TOKEN_ENV, "")
    beats = asyncio.create_task(heartbeat().run())  # progress for the flow's stall watch (engines/heartbeat.py)
    try:
        await _run(cfg, token)
    finally:
        beats.cancel()
    log.info("all rollout steps committed")


def _client(cfg: OrchestratorProcessConfig, token: str) -> httpx.AsyncClient:
    """The engine's client; a tenant's names the tenant and carries its token on every request (tenant.py)."""
    settings = http_client.settings(cfg.inference_url, 600.0)
    return httpx.AsyncClient(**settings) if cfg.tenant is None else TenantClient(cfg.tenant, token, **settings)


async def _run(cfg: OrchestratorProcessConfig, token: str) -> None:
    async with _client(cfg, token) as client:
        timeout = cfg.orchestrator.inference_timeout_s
        with heartbeat().waiting_on("inference", "waiting for the inference server"):
            # a tenant cannot check the shared server's admin token: deployment.json, which its flow read, names it
            await wait_healthy(client, timeout, "" if cfg.tenant is not None else token)
            if cfg.tenant is not None:
                await wait_registered(client, cfg.tenant, timeout)
        fs, root = Storage(cfg.run.storage).open(cfg.run.output_dir)
        sync = WeightSync(client, fs, root, token, cfg.orchestrator.poll_interval_s, cfg.tenant)
        await sync.refresh()
        tea = await start_teacher(cfg)
        orch = Orchestrator(cfg, client, sync, tea)
        online = OnlineEval(cfg, client, orch.limit, orch.tok, orch.mix.envs, sync, fs, root)
        online.start()  # eval.interval > 0: held-out evaluations alongside the rollouts (online_eval.py)
        sync.start()  # after online.start() has set its first hold
        try:
            orch.restore_pool()
            for step in orch.pending_steps():
                if sync.follower.done():
                    sync.follower.result()  # surfaces the follower's error
                online.check()
                await orch.run_step(step)
            with heartbeat().waiting_on("inference", "finishing the online evaluation"):
                await online.finish()
        finally:
            await orch.pool.cancel()  # groups still running after the last step are never committed
            online.cancel()
            sync.follower.cancel()
            for env in orch.mix.envs.values():
                if hasattr(env, "close"):
                    await env.close()
            if tea is not None:
                await tea.aclose()


async def start_teacher(cfg: OrchestratorProcessConfig) -> Teacher | None:
    """The teacher's client once its server answers, after checking it shares the student's tokenizer."""
    if cfg.teacher_url is None:
        return None
    await asyncio.to_thread(check_tokenizer, cfg.model, cfg.teacher)
    tea = Teacher(cfg.teacher, cfg.teacher_url)
    with heartbeat().waiting_on("teacher", "waiting for the teacher's server"):
        await wait_healthy(tea.client, cfg.orchestrator.inference_timeout_s, os.environ.get(TEACHER_TOKEN_ENV, ""))
    return tea


def forbid_torch() -> None:
    """Make torch unimportable in this process (a None entry in sys.modules), unless it is already loaded.

    Nothing the orchestrator runs needs torch, but transformers imports it whenever it is installed, also just
    to load a tokenizer (seconds and hundreds of MB per process; tokenizing never touches it). Hidden, torch
    reads as not installed to transformers, and anything that would really use it fails at its import.
    """
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    forbid_torch()
    cfg = OrchestratorProcessConfig.model_validate(read_process_config("engines.orchestrator", __doc__, argv))
    try:
        asyncio.run(run(cfg))
    except EnvironmentRefused as exc:  # a restart would fail the same way: the flow stops the run
        print(f"refused: {exc}", flush=True)
        raise SystemExit(EXIT_REFUSED) from None
