"""On-policy distillation in the orchestrator: the teacher scores every sampled token, and each token gets
its own advantage (docs/distillation.md).

    a group's rows -> one /v1/completions request per sample to the teacher's server (prompt = prompt_ids +
    completion_ids, prompt_logprobs = 0, max_tokens = 1; at most teacher.requests_in_flight open, each bounded
    by teacher.timeout_s) -> `teacher_logprobs`: the logprob of each completion token given all before it
    -> once the step's environment advantages are set: `token_advantages` =
       kl_coef * (teacher_logprob - sampler_logprob) + reward_coef * advantage   (0 on environment tokens)

teacher_logprob - sampler_logprob is the negative of the per-token reverse-KL estimate, so a token the
teacher finds likelier than the student did is pushed up. The teacher's logprobs are at temperature 1; the
sampler's are those of the distribution it drew from (orchestrator.temperature).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from config.model import ModelConfig
from config.teacher import TeacherConfig
from engines.models import modeldir
from engines.orchestrator import http_client
from engines.protocol import CompletionRequest, CompletionResponse, PromptLogprob
from storage.rollouts import RolloutRow, mean_teacher_gap

log = logging.getLogger("rollflow.orchestrator")


def completion_scores(entries: list[dict[str, PromptLogprob] | None], ids: list[int], start: int) -> list[float]:
    """The logprobs of ids[start:] from a response's `prompt_logprobs` (one entry per id, keyed by id as text)."""
    if len(entries) != len(ids):
        raise RuntimeError(f"the teacher returned {len(entries)} prompt_logprobs for {len(ids)} prompt tokens")
    out = []
    for k in range(start, len(ids)):
        entry = entries[k] or {}
        if str(ids[k]) not in entry:
            raise RuntimeError(f"the teacher's prompt_logprobs lack token {ids[k]} at position {k}")
        out.append(entry[str(ids[k])].logprob)
    return out


def mix(rows: list[RolloutRow], cfg: TeacherConfig, baseline: float = 0.0) -> None:
    """Each row's `token_advantages` from its teacher logprobs and its (environment) `advantage`; `baseline` is
    subtracted from every token's teacher - sampler gap (teacher.center: the step's mean gap)."""
    for row in rows:
        if row.teacher_logprobs is None:
            continue
        mask = row.completion_mask or [1] * len(row.completion_ids)
        row.token_advantages = [
            (cfg.kl_coef * (t - s - baseline) + cfg.reward_coef * row.advantage) if m else 0.0
            for t, s, m in zip(row.teacher_logprobs, row.completion_logprobs, mask, strict=True)
        ]


def teacher_kl(rows: list[RolloutRow]) -> float | None:
    """Mean sampler - teacher logprob over the rows' model tokens (what the trainer reports as teacher_kl)."""
    return mean_teacher_gap((r.completion_logprobs, r.teacher_logprobs, r.completion_mask) for r in rows)


class Teacher:
    """The teacher's server, as the orchestrator talks to it."""

    def __init__(self, cfg: TeacherConfig, url: str):
        self.cfg = cfg
        self.client = httpx.AsyncClient(**http_client.settings(url, cfg.timeout_s))
        self.limit = asyncio.Semaphore(cfg.requests_in_flight)

    async def score(self, rows: list[RolloutRow]) -> None:
        """Set every row's `teacher_logprobs` (one request per row, concurrently within the bound)."""
        scores = await asyncio.gather(*(self._score(r.prompt_ids, r.completion_ids) for r in rows))
        for row, lps in zip(rows, scores, strict=True):
            row.teacher_logprobs = lps

    async def _score(self, prompt: list[int], completion: list[int]) -> list[float]:
        ids = prompt + completion
        # one token must be drawn (max_tokens > 0); greedy, so nothing random is asked of the teacher
        request = CompletionRequest(prompt=ids, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        async with self.limit:
            r = await asyncio.wait_for(
                self.client.post("/v1/completions", json=request.model_dump(exclude_none=True)), self.cfg.timeout_s
            )
        if r.status_code != 200:
            raise RuntimeError(f"the teacher refused a scoring request: HTTP {r.status_code}: {r.text[:300]}")
        (choice,) = CompletionResponse.model_validate_json(r.content).choices
        if choice.prompt_logprobs is None:
            raise RuntimeError("the teacher's response lacks prompt_logprobs, which the request asked for")
        return completion_scores(choice.prompt_logprobs, ids, len(prompt))

    def set_advantages(self, rows: list[RolloutRow]) -> float | None:
        """Mix every row's token advantages (after its environment advantage is set); returns the teacher KL."""
        kl = teacher_kl(rows)
        mix(rows, self.cfg, -kl if self.cfg.center and kl is not None else 0.0)
        return kl

    async def aclose(self) -> None:
        await self.client.aclose()


def check_tokenizer(student: ModelConfig, cfg: TeacherConfig) -> None:
    """The teacher scores the student's token ids: refuse one with another tokenizer (modeldir.ModelDirError)."""
    modeldir.check_same_tokenizer(student, ModelConfig(path=cfg.path, impl=cfg.impl))
