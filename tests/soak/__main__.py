"""The chaos soak driver: `python -m tests.soak [--minutes M | --steps N] [--seed S] [--quick] [--out DIR]`.

Runs each segment of SEGMENTS (QUICK with --quick) in a folder of its own under --out, under one Prefect API
(the test harness's server), writes every SegmentResult to DIR/results.json and, unless --no-report, the tables
to docs/reliability.md (tests/soak/report.py). Exit status 1 when any segment's audit found a problem.
Adding a segment (Slurm preemption, node loss, ...) is one line in SEGMENTS: a callable
(workdir: Path, seed: int, minutes: float) -> SegmentResult.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.soak import multinode, ranks, segments, slurm
from tests.soak.record import SegmentResult
from tests.soak.report import write_report

Segment = Callable[[Path, int, float], SegmentResult]
# (callable, share of the minutes); the dense local segment carries most of the faults
SEGMENTS: list[tuple[Segment, float]] = [
    (segments.dense_local, 0.45),
    (segments.dense_s3, 0.17),
    (segments.moe, 0.1),
    (segments.multiturn, 0.1),
    (ranks.segment, 0.07),  # two gloo trainer ranks: a killed rank, a stopped one (a hung collective)
    (slurm.segment, 0.02),  # the real one-node Slurm: a preemption and a walltime (its run has a minimum length)
    (multinode.node_loss_segment, 0.09),  # the network-namespace cluster: a trainer node lost
]
QUICK: list[tuple[Segment, float]] = [(functools.partial(segments.dense_local, quick=True), 1.0)]


def _run_segment(segment: Segment, workdir: Path, seed: int, minutes: float) -> SegmentResult:
    """A segment that crashes is a finding of the report, not the end of the other segments."""
    t0 = time.monotonic()
    try:
        return segment(workdir, seed, minutes)
    except Exception as exc:  # noqa: BLE001 - any crash is reported, with its type and message
        name = getattr(segment, "__name__", None) or getattr(getattr(segment, "func", None), "__name__", "segment")
        problem = f"the segment crashed: {type(exc).__name__}: {exc}"
        return SegmentResult(name, "-", 0, round(time.monotonic() - t0, 1), problems=[problem], seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.splitlines()[0])
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=10.0, help="fault-injection time over all segments")
    length.add_argument("--steps", type=int, help="trained steps of the dense segment (the others: a quarter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one fault of each class that fits, ~2-3 minutes")
    p.add_argument("--out", type=Path, default=Path("outputs/soak"))
    p.add_argument("--no-report", action="store_true", help="do not rewrite docs/reliability.md")
    args = p.parse_args(argv)
    # --steps: the minutes that give the dense segment N steps (segments.steps_for: 40 steps a minute)
    minutes = args.minutes if args.steps is None else args.steps / (40 * SEGMENTS[0][1])
    from prefect.testing.utilities import prefect_test_harness

    results, t0 = [], time.monotonic()
    with prefect_test_harness(server_startup_timeout=120):
        from prefect.settings import PREFECT_API_URL

        os.environ["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
        for i, (segment, share) in enumerate(QUICK if args.quick else SEGMENTS):
            workdir = args.out / f"segment-{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            result = _run_segment(segment, workdir.resolve(), args.seed + i, minutes * share)
            results.append(result)
            print(f"{result.name}: {len(result.faults)} faults, {len(result.problems)} problems", flush=True)
    (args.out / "results.json").write_text(json.dumps([r.to_json() for r in results], indent=1))
    if not args.no_report:
        command = "python -m tests.soak " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(results, command, args.seed, time.monotonic() - t0)
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
