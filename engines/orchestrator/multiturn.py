"""A group of multi-turn episodes for one task: `group_size` episodes run concurrently, each a sequence
of single-sample requests to the inference server under its own session id, scored by the
environment and turned into one `RolloutRow` per episode (engines/environments/episodes.py describes the columns).
`EpisodeGroup` is also the `GroupSampler` an environment that runs its own episodes samples through
(verifiers environments); the orchestrator's loop sets every group's advantages (engines/orchestrator/loop.py).
"""

from __future__ import annotations

import asyncio

import httpx

from config.orchestrator import OrchestratorConfig
from engines.environments.base import Task
from engines.environments.episodes import Episode, MultiTurnEnvironment, RequestBuilder, run_episode
from engines.models.tokenizer import Tokenizer
from engines.protocol import SESSION_HEADER, CompletionChoice, CompletionRequest, CompletionResponse
from engines.seeds import derive_seed
from storage import rollouts
from storage.rollouts import RolloutRow


def truncation(ocfg: OrchestratorConfig) -> dict:
    """The request fields of orchestrator.top_p / top_k, sent with every request the orchestrator makes. With
    truncation it also asks for each token's kept support size (`return_kept_sizes`), which the lake stores as
    `completion_kept` for the trainer (docs/algorithm.md "Keep sampling mask"); without, nothing is added."""
    if ocfg.top_p >= 1 and ocfg.top_k == 0:
        return {}
    return {"top_p": ocfg.top_p, "top_k": ocfg.top_k, "return_kept_sizes": True}


async def post_completion(
    client: httpx.AsyncClient,
    limit: asyncio.Semaphore,
    request: CompletionRequest,
    session_id: str,
    session_header: str = SESSION_HEADER,
) -> CompletionResponse:
    """One completion call of every rollout path (a group's n samples, or one turn of an episode). `session_id`
    is stable for every request of one rollout session and travels in `session_header`
    (inference.router.session_header), which keeps a session on one replica; a 400 (e.g. prompt + max_tokens
    over max_seq_len) names the session."""
    async with limit:
        r = await client.post(
            "/v1/completions", json=request.model_dump(exclude_none=True), headers={session_header: session_id}
        )
    if r.status_code == 400:
        raise RuntimeError(f"inference refused session {session_id}: {r.json().get('detail')}")
    r.raise_for_status()
    return CompletionResponse.model_validate_json(r.content)


class EpisodeGroup:
    """The shared pieces of one group: where to send requests and how to build them (a `GroupSampler`)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        limit: asyncio.Semaphore,
        tok: Tokenizer,
        ocfg: OrchestratorConfig,
        seed: int,
        max_seq_len: int,
        session_header: str = SESSION_HEADER,
    ):
        self.client, self.limit, self.tok, self.ocfg = client, limit, tok, ocfg
        self.seed, self.max_seq_len, self.session_header = seed, max_seq_len, session_header
        self.group_size, self.temperature = ocfg.group_size, ocfg.temperature

    def request(self, step: int, group: int, k: int) -> RequestBuilder:
        def build(context: list[int], room: int, turn: int) -> CompletionRequest:
            return CompletionRequest(
                prompt=context,
                max_tokens=max(1, min(self.ocfg.max_new_tokens, room)),
                temperature=self.ocfg.temperature,
                logprobs=1,
                return_token_ids=True,
                # a pure function of (seed, step, group, episode, turn): a resumed run redraws the same episodes
                seed=derive_seed(self.seed, step, group, k + 1, turn),
                **truncation(self.ocfg),
            )

        return build

    async def sample(self, request: CompletionRequest, session_id: str) -> CompletionChoice:
        (choice,) = (await post_completion(self.client, self.limit, request, session_id, self.session_header)).choices
        return choice

    async def run(self, env: MultiTurnEnvironment, task: Task, run_id: str, step: int, group: int) -> list[RolloutRow]:
        """The group's episodes, scored by the environment (the advantages are the caller's)."""
        group_id = rollouts.group_id(step, group)
        episodes = await asyncio.gather(
            *(
                run_episode(
                    env,
                    task,
                    self.tok,
                    self.sample,
                    self.request(step, group, k),
                    f"{run_id}/{rollouts.sample_id(group_id, k)}",
                    self.max_seq_len,
                )
                for k in range(self.ocfg.group_size)
            )
        )
        scores = [env.score(task, e.replies) for e in episodes]
        pairs = zip(episodes, scores, strict=True)
        return [self._row(run_id, step, group_id, k, task, e, reward) for k, (e, reward) in enumerate(pairs)]

    def _row(self, run_id: str, step: int, group_id: str, k: int, task: Task, e: Episode, reward: float) -> RolloutRow:
        return e.row(
            task,
            run_id,
            step,
            rollouts.sample_id(group_id, k),
            group_id,
            reward=reward,
            temperature=self.ocfg.temperature,
        )
