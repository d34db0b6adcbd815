"""The trainer's side of evaluation during RL: merge each finished online evaluation (evals/online/version=V,
written by the orchestrator, engines/orchestrator/online_eval.py) into metrics.jsonl and MLflow.

    summary `metrics` of version V (eval/reward_mean, eval/<env>/reward_mean, eval/<env>/pass@<k>)
    -> the row of step V (version 0: a row {"step": 0, ...} of its own), logged to MLflow at step V

The trainer is the single writer of metrics.jsonl: a version is merged once its step's row exists (V <= the
trainer's version), and a row that already holds eval keys (merged before a restart) is not merged again. At the
end the trainer waits, bounded by eval.final_timeout_s, for the final version's evaluation.
"""

from __future__ import annotations

import logging
import time

from config.eval import EvalConfig
from engines.trainer.tracking import Tracker
from storage import evals

log = logging.getLogger("rollflow.trainer")


class EvalMerger:
    def __init__(self, fs, root: str, tracker: Tracker, ecfg: EvalConfig):
        self.fs, self.root, self.tracker, self.ecfg = fs, root, tracker, ecfg
        # read once: the trainer is metrics.jsonl's only writer, so what it merges later is added here
        rows = tracker.metrics.rows().items() if ecfg.interval > 0 else ()
        self._merged = {step for step, row in rows if any(k.startswith("eval/") for k in row)}

    def merged(self, version: int) -> bool:
        return version in self._merged

    def merge(self, upto: int) -> None:
        """Merge every finished evaluation of a version <= `upto` not merged yet."""
        if self.ecfg.interval <= 0:
            return
        for version in evals.online_versions(self.fs, self.root, finished=False):
            if version > upto or self.merged(version):
                continue
            summary = evals.read_summary(self.fs, evals.online_dir(self.root, version))
            if summary and summary.get("metrics"):
                self.tracker.merge(version, summary["metrics"])
                self._merged.add(version)
                log.info(f"eval of version {version}: reward {summary['reward_mean']:.3f} (merged into metrics)")

    def wait_final(self, version: int) -> None:
        """Merge until the evaluation of `version` is in, at most eval.final_timeout_s."""
        if self.ecfg.interval <= 0:
            return
        deadline = time.monotonic() + self.ecfg.final_timeout_s
        while True:
            self.merge(version)
            if self.merged(version):
                return
            if time.monotonic() > deadline:
                log.warning(
                    f"no evaluation of the final version {version} within eval.final_timeout_s="
                    f"{self.ecfg.final_timeout_s}s; finishing without it"
                )
                return
            time.sleep(0.5)
