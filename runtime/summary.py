"""The end-of-run summaries of the `rl` and `sft` flows: what a person reads first (console and Prefect artifact).

`summarize` reads metrics.jsonl and the rollout manifests into a few scalars (printed, returned by the flow);
`to_markdown` renders them, and, given the metrics rows, the reward and held-out evaluation curves
(curves.py: sparklines and tables of at most ~50 rows). `summarize_sft` and `sft_markdown` do the same for a
`rollflow sft` run: its loss curve, what its data held and skipped, and its final publication.
"""

from __future__ import annotations

import json
from collections import Counter

from runtime.curves import curves_markdown, downsample
from storage.fs import join, read_manifest
from storage.metrics import SFT_DATA_FILE, metric_curve, read_metrics
from storage.rollouts import committed_rollout_steps, staleness, step_path
from storage.weights import latest_version


def summarize(fs, root: str, output_dir: str, wall_s: float) -> dict:
    rows = read_metrics(fs, root)
    hist: Counter[int] = Counter()
    for step in committed_rollout_steps(fs, root):
        manifest = read_manifest(fs, step_path(root, step))
        hist.update({staleness(step, int(v)): n for v, n in manifest["versions"].items()})
    rewards = [v for _, v in metric_curve(rows, "reward_mean")]  # rows of evaluations alone carry none
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


def to_markdown(s: dict, rows: list[dict] | None = None) -> str:
    """The summary table; with `rows` (metrics.jsonl), followed by the run's curves."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["# rollflow RL run summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in s.items()]
    curves = curves_markdown(rows or [])
    return "\n".join(lines + (["", curves] if curves else []))


def summarize_sft(fs, root: str, output_dir: str, wall_s: float, points: int = 20) -> dict:
    """A `rollflow sft` run: the loss curve (at most `points` steps), what the data held and what was skipped,
    and the final publication (the directory `[model] path` takes)."""
    rows = {r["step"]: r for r in read_metrics(fs, root)}
    report = join(root, SFT_DATA_FILE)
    data = json.loads(fs.cat_file(report)) if fs.exists(report) else {}
    steps = sorted(rows)
    losses = [rows[s]["loss"] for s in steps]
    k = min(5, len(losses))
    final = latest_version(fs, root)
    return {
        "output_dir": output_dir,
        "steps": len(steps),
        "wall_s": round(wall_s, 1),
        "loss_first5": sum(losses[:k]) / k if k else None,
        "loss_last5": sum(losses[-k:]) / k if k else None,
        "trained_tokens": sum(int(rows[s]["trained_tokens"]) for s in steps),
        "epochs": rows[steps[-1]].get("epoch") if steps else None,
        "data_source": data.get("source"),
        "data_rows": data.get("rows"),
        "data_samples": data.get("samples"),
        "skipped_rows": data.get("skipped", {}),
        "final_weights": None if final is None else f"{output_dir.rstrip('/')}/weights/step={final:06d}",
        "loss_curve": {s: rows[s]["loss"] for s in downsample(steps, points)},
    }


def sft_markdown(s: dict, rows: list[dict]) -> str:
    """The summary as a table of its values, then the loss curve of the metrics `rows` (curves.py: a
    sparkline and a table of at most ~50 steps)."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["# rollflow SFT run summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in s.items() if k != "loss_curve"]
    curves = curves_markdown(rows, key="loss")
    return "\n".join(lines + (["", curves] if curves else []))
