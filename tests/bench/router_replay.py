"""Benchmark 7: router replay (R3) against a bf16 sampler, on the tiny MoE.

The engine samples in bfloat16 (`inference.dtype`), the trainer scores in float32, as production pairs a
bf16 vLLM with an fp32 trainer. Per seed: one warm-up (profiles/tiny-moe-cpu.toml, shortened), then two
RL runs from it, router replay on and off; both record the sampler's routing. Step 1 of the two runs
scores the very same samples with the very same weights, so it is a paired comparison; later steps
diverge as the runs train differently. Reported per run: mismatch_kl (token mean over the run's steps) and
expert_mismatch (the fraction of scored tokens whose top-k expert set, picked by the trainer's own
router, differs from the sampler's in any layer), medians over the seeds.

`python -m tests.bench router_replay` runs it alone.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tests.bench.harness import QUICK, ROOT, Workspace, direct_run, num, table, warm_up

TITLE = "7. MoE: router replay against a bf16 sampler"
SEEDS = (0,) if QUICK else (0, 1, 2)
PROFILE = ROOT / "profiles/tiny-moe-cpu.toml"
OVERRIDES = {
    "max_steps": 2 if QUICK else 5,
    "sft.steps": 20 if QUICK else 100,
    "orchestrator.batch_size": 16,
    "inference.dtype": "bfloat16",
    "inference.enable_return_routed_experts": True,
    "tracking.mlflow": False,
}


def _config(out: Path, seed: int, replay: bool):
    from config.loader import load_run_config

    pairs = {**OVERRIDES, "output_dir": str(out), "seed": seed, "trainer.enable_router_replay": replay}
    return load_run_config([PROFILE], [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in pairs.items()])


def _read(out: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    scored = [r for r in rows if r["mismatch_kl"] is not None]
    tokens = sum(r["mismatch_tokens"] for r in scored)
    return {
        "kl": sum(r["mismatch_kl"] * r["mismatch_tokens"] for r in scored) / tokens,
        "kl_step1": rows[0]["mismatch_kl"],
        "experts": statistics.mean(r["expert_mismatch"] for r in scored),
        "experts_step1": rows[0]["expert_mismatch"],
        "reward": rows[-1]["reward_mean"],
    }


def measure(root: Path) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for seed in SEEDS:
        template = warm_up(_config(root / f"warmup-{seed}", seed, True))
        for side in ("on", "off"):
            out = direct_run(_config(root / f"{side}-{seed}", seed, side == "on"), template)
            results[side].append(_read(out))
    return results


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(results: dict[str, list[dict[str, float]]]) -> str:
    rows = []
    for side in ("on", "off"):
        runs = results[side]
        per_seed = ", ".join(num(r["kl"], 3) for r in runs)
        rows.append(
            [
                f"replay {side}",
                num(_median(runs, "kl"), 3),
                per_seed,
                num(_median(runs, "kl_step1"), 3),
                f"{_median(runs, 'experts'):.1%}",
                f"{_median(runs, 'experts_step1'):.1%}",
            ]
        )
    ratio = statistics.median(
        off["kl_step1"] / on["kl_step1"] for on, off in zip(results["on"], results["off"], strict=True)
    )
    head = [
        "trainer",
        "mismatch_kl (median)",
        "per seed",
        "step 1 (paired)",
        "tokens with another expert set",
        "step 1",
    ]
    return (
        f'Seeds {list(SEEDS)}, {OVERRIDES["max_steps"]} RL steps each, `inference.dtype = "bfloat16"`, fp32 trainer. '
        "With replay on, the trainer still routes afresh to count disagreements but computes with the "
        "sampler's experts, so no scored token uses another expert set.\n\n"
        + table(head, rows)
        + f"\n\nStep 1 (same samples, same weights on both sides): mismatch_kl off / on = {num(ratio, 3)}x "
        "(median over seeds).\n"
    )


def run(ws: Workspace) -> str:
    return report(measure(ws.root / "router_replay"))
