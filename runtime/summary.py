"""The end-of-run summary: what a person reads first (console and Prefect artifact)."""

from __future__ import annotations

from collections import Counter

from storage.fs import read_manifest
from storage.metrics import read_metrics
from storage.rollouts import committed_rollout_steps, staleness, step_path


def summarize(fs, root: str, output_dir: str, wall_s: float) -> dict:
    rows = read_metrics(fs, root)
    hist: Counter[int] = Counter()
    for step in committed_rollout_steps(fs, root):
        manifest = read_manifest(fs, step_path(root, step))
        hist.update({staleness(step, int(v)): n for v, n in manifest["versions"].items()})
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]  # not in version 0's eval-only row
    kls = [r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None]
    k = min(5, len(rewards))
    return {
        "output_dir": output_dir,
        "steps": len(rewards),
        "wall_s": round(wall_s, 1),
        "reward_first5": sum(rewards[:k]) / k if k else None,
        "reward_last5": sum(rewards[-k:]) / k if k else None,
        "mismatch_kl_max": max(kls) if kls else None,
        "staleness_histogram": dict(sorted(hist.items())),
    }


def to_markdown(s: dict) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["# rollflow RL run summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in s.items()]
    return "\n".join(lines)
