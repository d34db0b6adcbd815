"""Keep sampling mask (docs/algorithm.md): mismatch_kl with the sampler's top-p / top-k support applied vs not.

    python -m tests.bench.keep_sampling_mask [--steps N] [--out DIR] [--only NAME ...]

Runs the full tiny-cpu profile (profiles/tiny-cpu.toml, its warm-up included) through the real CLI, one
output directory per run, same seed: top_p = 1 (the baseline), top_p = 0.9 and top_k = 20 each with
trainer.keep_sampling_mask true and false. Prints a markdown table of mismatch_kl (max and median over the
steps of OUTPUT_DIR/metrics.jsonl), support_mismatch_tokens and the learning curve (reward_mean, mean of
the first 5 and the last 5 steps). About 2 minutes a run on 2 uncontended cores. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench import harness

TITLE = "Keep sampling mask: mismatch_kl with the sampler's support applied or not (tests/bench/keep_sampling_mask.py)"
ROOT = Path(__file__).resolve().parents[2]
QUICK_RUN = "top_p=0.9 applied"  # the quick mode's one run: the mask applied, the path that can break
RUN_TIMEOUT_S = 1800

RUNS: dict[str, list[str]] = {
    "top_p=1": [],
    "top_p=0.9 applied": ["--orchestrator.top_p", "0.9"],
    "top_p=0.9 not applied": ["--orchestrator.top_p", "0.9", "--trainer.keep_sampling_mask", "false"],
    "top_k=20 applied": ["--orchestrator.top_k", "20"],
    "top_k=20 not applied": ["--orchestrator.top_k", "20", "--trainer.keep_sampling_mask", "false"],
}


def command(out: Path, extra: list[str], steps: int | None) -> list[str]:
    args = ["rl", "@", str(ROOT / "profiles/tiny-cpu.toml"), "--output-dir", str(out), *extra]
    if steps is not None:
        args += ["--max-steps", str(steps)]
    if harness.QUICK:
        args += ["--sft.steps", "20"]
    return [sys.executable, "-m", "rollflow.cli", *args]


def summary(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kls = [r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None]
    rewards = [r["reward_mean"] for r in rows]
    return {
        "steps": len(rows),
        "kl_max": max(kls) if kls else float("nan"),
        "kl_median": statistics.median(kls) if kls else float("nan"),
        "support_mismatch": sum(r.get("support_mismatch_tokens", 0) for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "reward_first5": sum(rewards[:5]) / len(rewards[:5]),
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
    }


def table(results: dict[str, dict]) -> str:
    lines = [
        "| run | steps | mismatch_kl max | mismatch_kl median | support_mismatch_tokens / tokens "
        "| reward first 5 | reward last 5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s['steps']} | {s['kl_max']:.1e} | {s['kl_median']:.1e} | "
            f"{s['support_mismatch']} / {s['tokens']} | {s['reward_first5']:.3f} | {s['reward_last5']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: the profile's 100)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    parser.add_argument("--only", nargs="*", choices=list(RUNS), help="run these only")
    args = parser.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="keep-sampling-mask-"))
    print(table(runs(root, args.only or list(RUNS), args.steps)))
    return 0


def runs(root: Path, names: list[str], steps: int | None) -> dict[str, dict]:
    """Each named run through the real CLI, one after another; raises on the first that fails."""
    results = {}
    for name in names:
        out = root / name.replace(" ", "_").replace("=", "")
        t0 = time.perf_counter()
        proc = subprocess.run(command(out, RUNS[name], steps), cwd=ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)  # fmt: skip
        if proc.returncode != 0:
            tail = proc.stdout[-3000:] + proc.stderr[-3000:]
            raise RuntimeError(f"{name}: the run failed (exit {proc.returncode}):\n{tail}")
        results[name] = summary(out)
        print(f"{name}: {time.perf_counter() - t0:.0f}s, {out}", file=sys.stderr)
    return results


def run(ws: harness.Workspace) -> str:
    """The runner's entry: in quick mode (`python -m tests.bench --every --quick`) one run of 2 steps after a
    20-step warm-up; otherwise every run at the profile's length."""
    names, steps = ([QUICK_RUN], 2) if harness.QUICK else (list(RUNS), None)
    return table(runs(ws.root / "keep_sampling_mask", names, steps))


if __name__ == "__main__":
    raise SystemExit(main())
