"""Evaluation during RL (`eval.interval > 0`): the orchestrator evaluates the policy the engine serves on the
held-out split, concurrently with rollout generation and through the same request semaphore.

    targets: version 0, every multiple of eval.interval, max_steps
    per target V (in order): hold the engine at V (WeightSync.hold: no newer version is pushed) -> wait until it
    serves V -> evaluate (engines/orchestrator/evaluation.py) into evals/online/version=V/ (never rollouts/: the
    trainer does not train on these samples) -> release; so every row is sampled by V alone (its policy_version)
    after the last rollout step: wait, bounded by eval.final_timeout_s, for the remaining targets (max_steps last)

The trainer merges each finished summary's `metrics` into metrics.jsonl (engines/trainer/rl.py). After a resume
from checkpoint C the rollback has removed the evaluations of versions after C and unfinished ones before it
(storage/resume.py); targets before C are not evaluated again, C itself continues from its committed chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time

from config.process import OrchestratorProcessConfig
from engines.environments.base import Environment
from engines.heartbeat import heartbeat
from engines.models.tokenizer import Tokenizer
from engines.orchestrator.evaluation import Evaluator, spec_for_envs
from storage import evals

log = logging.getLogger("rollflow.orchestrator")


def targets(max_steps: int, interval: int) -> list[int]:
    return sorted({0, max_steps, *range(interval, max_steps + 1, interval)})


class OnlineEval:
    def __init__(self, cfg: OrchestratorProcessConfig, client, limit: asyncio.Semaphore, tok: Tokenizer,
                 envs: dict[str, Environment], sync, fs, root: str):  # fmt: skip
        self.cfg, self.client, self.limit, self.tok, self.envs = cfg, client, limit, tok, envs
        self.sync, self.fs, self.root = sync, fs, root
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.cfg.eval.interval > 0:
            # versions before the one served now are not served again (a resumed run)
            todo = [v for v in targets(self.cfg.max_steps, self.cfg.eval.interval) if v >= self.sync.engine_version]
            self.sync.hold = todo[0] if todo else None  # before the follower can push past the first target
            self.task = asyncio.create_task(self.run(todo))

    async def run(self, todo: list[int]) -> None:
        """Rollouts wait for a held version's evaluation only when they need a newer policy (the async bound);
        the evaluation takes seconds (docs/evaluation.md)."""
        try:
            for version in todo:
                self.sync.hold = version
                await self.sync.wait_for(version)
                await self.evaluate(version)
        finally:
            self.sync.hold = None

    async def evaluate(self, version: int) -> None:
        directory = evals.online_dir(self.root, version)
        target = {"online": True, "run_id": self.cfg.run.run_id, "version": version}
        spec = spec_for_envs(self.cfg.eval, self.cfg.envs, self.cfg.seed, self.cfg.orchestrator.max_new_tokens, target)
        status = await asyncio.to_thread(evals.claim, self.fs, directory, spec, True)
        if status == "done":
            return
        served, t0 = self.sync.engine_version, time.perf_counter()
        # while it runs the engine is held at `version`: rollouts needing a newer one wait on this, not the trainer
        with heartbeat().waiting_on("inference", f"evaluating version {version}", priority=1):
            summary = await Evaluator(
                self.client,
                self.limit,
                self.tok,
                self.envs,
                spec,
                self.fs,
                directory,
                self.cfg.session_header,
                max_seq_len=self.cfg.model.max_seq_len,
            ).run()
        log.info(
            f"eval of version {version} (engine served {served}, samples from {summary['policy_versions']}): "
            f"reward {summary['reward_mean']:.3f}, {time.perf_counter() - t0:.2f}s"
        )

    async def finish(self) -> None:
        """After the last rollout step: the remaining evaluations, the final version's last, bounded."""
        if self.task is None:
            return
        try:
            await asyncio.wait_for(self.task, self.cfg.eval.final_timeout_s)
        except TimeoutError:
            log.warning(
                f"online evaluation not finished within eval.final_timeout_s={self.cfg.eval.final_timeout_s}s "
                f"(waiting for version {self.cfg.max_steps}); leaving it unfinished"
            )

    def check(self) -> None:
        """Surface a failed evaluation (its error) while rollouts go on."""
        if self.task is not None and self.task.done() and not self.task.cancelled():
            self.task.result()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
