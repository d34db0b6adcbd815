"""Memory over a long fault-free run: `python -m tests.soak.flat [--steps N] [--from-step K] [--out DIR]`.

Runs `rollflow rl` of the default profile (profiles/tiny-cpu.toml, MLflow on, as a user runs it) for N steps with
tests/soak/memory.py's sampler every 5 s, and prints per process (flow, trainer, orchestrator, inference) the RSS
at step K and at the end and the least-squares slope from step K on, in KiB per trained step. Step K leaves out
start-up, the warm-up and the first steps' allocations; a leak is a slope that stays above the noise however
long the run. Nothing restarts in a fault-free run, so each name is one process throughout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tests.integration.conftest import ROOT, TINY, start_cli
from tests.soak.memory import MemorySampler, _slope


def _steps(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_bytes().split(b"\n")) - 1
    except FileNotFoundError:
        return 0


def summarise(mem: MemorySampler, from_step: int) -> dict[str, dict[str, float]]:
    table = {}
    for name in sorted({s.name for s in mem.samples}):
        series = [s for s in mem.samples if s.name == name and s.step >= from_step]
        if len(series) >= 3:
            slope = _slope([s.step for s in series], [s.rss_mb for s in series]) * 1024
            table[name] = {"rss_mb_at_from": round(series[0].rss_mb, 1), "rss_mb_last": round(series[-1].rss_mb, 1),
                           "slope_kib_per_step": round(slope, 2), "samples": len(series)}  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak.flat", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--from-step", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak-flat")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run = args.out / "run"
    cli = start_cli(args.out, args.out / "cli.log", None, "rl", "@", str(TINY), "--max-steps", str(args.steps),
                    "--output-dir", str(run), "--overwrite")  # fmt: skip
    t0 = time.monotonic()
    with MemorySampler(lambda: cli.pid, lambda: _steps(run), every_s=5.0) as mem:
        rc = cli.wait(timeout=3600)
    table = summarise(mem, args.from_step)
    print(json.dumps({"rc": rc, "steps": _steps(run), "wall_s": round(time.monotonic() - t0), **table}, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
