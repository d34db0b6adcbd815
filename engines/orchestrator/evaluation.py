"""Evaluation on the environments' held-out splits, over the inference HTTP API (no torch).

    spec (what the samples depend on) -> chunks: per environment, blocks of `block_tasks` task indices
    -> per task: `eval_task(i)` rendered by the tokenizer (with its images, engines/orchestrator/prompts.py), one
       /v1/completions request for its `n` samples (seed: derive_seed(seed, EVAL_SEED_TAG, crc32(env), i)),
       rewards by the environment; an image prompt over `max_seq_len` is left out (no rows), never cut
    -> each chunk committed as soon as its tasks are in (storage/evals.py), chunks already committed skipped
    -> the summary (engines/orchestrator/eval_metrics.py) from the rows read back, so a resumed evaluation
       summarizes exactly what an uninterrupted one would.

`rollflow eval` (flows/eval.py) runs it against a server of its own; during RL the orchestrator runs it on
the engine it samples rollouts from, sharing its request semaphore (engines/orchestrator/online_eval.py).
Only single-turn environments with a held-out split (`HeldOut`) are evaluated; `unevaluable` says why not.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from config.envs import EnvSpec
from config.eval import EvalConfig
from config.run import RunConfig
from engines.environments.base import Environment, HeldOut, has_held_out
from engines.environments.episodes import GroupEnvironment, is_multi_turn
from engines.models.tokenizer import Tokenizer
from engines.orchestrator.eval_metrics import summarize
from engines.orchestrator.multiturn import post_completion
from engines.orchestrator.prompts import Prompts
from engines.protocol import SESSION_HEADER, CompletionRequest
from engines.seeds import derive_seed
from storage import evals
from storage.evals import EvalRow

log = logging.getLogger("rollflow.eval")

EVAL_SEED_TAG = 0x6576616C  # "eval": keeps evaluation seeds apart from the rollouts' (seed, step, group)


def unevaluable(env: object) -> str | None:
    """Why `env` cannot be evaluated, or None."""
    if not has_held_out(env):
        return (
            "it has no held-out split (an `eval_size` int and an `eval_task(index)` method that training never "
            "draws from; docs/environments.md)"
        )
    if isinstance(env, GroupEnvironment) or is_multi_turn(env):
        return "it runs multi-turn episodes, which evaluation does not run (single-turn environments only)"
    return None


def make_spec(ecfg: EvalConfig, envs: list[str], seed: int, max_new_tokens: int, target: dict) -> dict:
    """What the samples and the summary depend on; stored as `_eval.json`, and a rerun continues only with
    the same spec."""
    return {
        "envs": envs,
        "num_tasks": ecfg.num_tasks,
        "n": ecfg.n,
        "temperature": ecfg.temperature,
        "max_new_tokens": max_new_tokens,
        "block_tasks": ecfg.block_tasks,
        "seed": ecfg.seed if ecfg.seed is not None else seed,
        "k": sorted(set(ecfg.k)),
        "correct_threshold": ecfg.correct_threshold,
        "target": target,
    }


def spec_for(cfg: RunConfig, target: dict) -> dict:
    """The spec of evaluating `target` with a run config's `[eval]` settings and environments."""
    return spec_for_envs(cfg.eval, cfg.envs, cfg.seed, cfg.orchestrator.max_new_tokens, target)


def spec_for_envs(e: EvalConfig, envs: list[EnvSpec], seed: int, max_new_tokens: int, target: dict) -> dict:
    names = e.envs or [s.label for s in envs]
    return make_spec(e, names, seed, e.max_new_tokens or max_new_tokens, target)


@dataclass(frozen=True)
class Chunk:
    index: int
    env: str
    start: int  # task indices start..stop-1
    stop: int


def chunks(spec: dict) -> list[Chunk]:
    out: list[Chunk] = []
    for env in spec["envs"]:
        for start in range(0, spec["num_tasks"], spec["block_tasks"]):
            out.append(Chunk(len(out), env, start, min(start + spec["block_tasks"], spec["num_tasks"])))
    return out


def task_seed(seed: int, env: str, index: int) -> int:
    """A task's sampling seed: independent of which other environments are evaluated, and of the order."""
    return derive_seed(seed, EVAL_SEED_TAG, zlib.crc32(env.encode()), index)


class Evaluator:
    """Runs one evaluation (`spec`) into `directory`; `progress(tasks)` is called as tasks finish."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        limit: asyncio.Semaphore,
        tok: Tokenizer,
        envs: dict[str, Environment],
        spec: dict,
        fs,
        directory: str,
        session_header: str = SESSION_HEADER,
        progress: Callable[[int], None] | None = None,
        max_seq_len: int | None = None,
    ):
        self.client, self.limit, self.tok, self.envs, self.spec = client, limit, tok, envs, spec
        self.prompts = Prompts(tok, max_seq_len, spec["max_new_tokens"])
        self.fs, self.directory, self.session_header = fs, directory, session_header
        self.progress = progress or (lambda _: None)

    def pending(self) -> list[Chunk]:
        done = set(evals.committed_chunks(self.fs, self.directory))
        return [c for c in chunks(self.spec) if c.index not in done]

    async def run(self) -> dict:
        """Every pending chunk (concurrently, bounded by the request semaphore), then the summary."""
        pending = await asyncio.to_thread(self.pending)
        skipped = sum(c.stop - c.start for c in chunks(self.spec)) - sum(c.stop - c.start for c in pending)
        if skipped:
            log.info(f"{self.directory}: {len(chunks(self.spec)) - len(pending)} chunks already committed")
            self.progress(skipped)
        await asyncio.gather(*(self.run_chunk(c) for c in pending))
        table = await asyncio.to_thread(evals.read_samples, self.fs, self.directory)
        summary = summary_of(table, self.spec)
        await asyncio.to_thread(evals.write_summary, self.fs, self.directory, summary)
        return summary

    async def run_chunk(self, chunk: Chunk) -> None:
        rows = await asyncio.gather(*(self.task_rows(chunk, i) for i in range(chunk.start, chunk.stop)))
        meta = {"env": chunk.env, "tasks": [chunk.start, chunk.stop]}
        flat = [r for task in rows for r in task]
        await asyncio.to_thread(evals.write_chunk, self.fs, self.directory, chunk.index, flat, meta)

    async def task_rows(self, chunk: Chunk, index: int) -> list[EvalRow]:
        env = self.envs[chunk.env]
        assert has_held_out(env)
        task = await asyncio.to_thread(_held_out(env).eval_task, index)
        prompt = self.prompts.render(task, self.spec["n"])
        if prompt is None:  # an image prompt over max_seq_len, or a bad image: no samples (prompts.py logs it)
            self.progress(1)
            return []
        prompt_ids = prompt.ids
        seed = task_seed(self.spec["seed"], chunk.env, index)
        request = CompletionRequest(
            prompt=prompt_ids,
            **prompt.request_fields(),
            n=self.spec["n"],
            max_tokens=self.spec["max_new_tokens"],
            temperature=self.spec["temperature"],
            return_token_ids=True,
            seed=seed,
        )
        session = f"eval-{zlib.crc32(self.directory.encode()):08x}-{chunk.index}-{index}"
        response = await post_completion(self.client, self.limit, request, session, self.session_header)
        rows = []
        for k, c in enumerate(response.choices):
            reward = float(env.reward(task, c.text))
            rows.append(
                EvalRow(
                    env=chunk.env,
                    task_index=index,
                    sample_index=k,
                    policy_version=c.policy_version,
                    policy_version_end=c.policy_version_end,
                    prompt_ids=prompt_ids,
                    completion_ids=c.token_ids or [],
                    reward=reward,
                    correct=reward >= self.spec["correct_threshold"],
                    temperature=self.spec["temperature"],
                    seed=seed,
                    finish_reason=c.finish_reason,
                    prompt_text=task.prompt,
                    completion_text=c.text,
                    answer=task.answer,
                )
            )
        self.progress(1)
        return rows


def _held_out(env: object) -> HeldOut:
    return env  # type: ignore[return-value]  # checked by has_held_out


def summary_of(table, spec: dict) -> dict:
    """The summary JSON of an evaluation's rows (pyarrow table with EVAL_SCHEMA): the metrics per environment
    and overall, and the policy versions that sampled (each sample's own is in its row)."""
    cols = [table.column(c).to_pylist() for c in ("env", "task_index", "reward", "correct")]
    versions = sorted(set(table.column("policy_version").to_pylist()))
    return {
        "samples": table.num_rows,
        "policy_versions": versions,
        **summarize(zip(*cols, strict=True), spec["envs"], spec["k"]),
        "spec": spec,
    }
