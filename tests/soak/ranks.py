"""Soak segment for a 2-rank FSDP2 trainer (profiles/tiny-cpu-fsdp2.toml: 2 gloo ranks under torchrun) in a
local `rollflow rl` run: one rank at a time SIGKILLed (`sigkill:rank`: torchrun fails the trainer, the flow
restarts the attempt) or SIGSTOPped (`sigstop:rank`: the other rank hangs in the next collective; the stall
watch, restart.stall.*, stops the attempt and restarts it), several times as the seed draws, each after the
run made checkpoint progress; then the resume audit (tests/integration/test_resume.py) on the run directory.

A fault's recovery time runs from the signal to the first trainer step recorded after both ranks were
replaced; steps rolled back = steps recorded before the restart minus the checkpoint it restarted from.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration suite's helpers

from conftest import start_cli  # noqa: E402
from test_parallel_run import FSDP2, _ranks  # noqa: E402
from test_resume import (  # noqa: E402
    RESUME,
    _assert_nothing_lost_or_duplicated,
    _checkpoints,
    _committed_rollouts,
    _trained_steps,
    _wait_for_progress,
    _wait_gone,
)
from test_stalls import STALL  # noqa: E402

from tests.soak.record import FaultRecord, SegmentResult  # noqa: E402
from tests.soak.recovery import resume_point, stepped_since  # noqa: E402

KINDS = {"sigkill:rank": signal.SIGKILL, "sigstop:rank": signal.SIGSTOP}
SECONDS_PER_FAULT = 75  # a stall timeout (20 s) or a crash, the restart of torchrun and its ranks, progress
STEPS_PER_FAULT = 4  # a checkpoint interval (2) of progress between faults, and the steps redone


def schedule(rng: random.Random, minutes: float) -> list[str]:
    """The fault kinds in order: one per SECONDS_PER_FAULT of the segment, at least one of each kind."""
    count = max(len(KINDS), int(minutes * 60 / SECONDS_PER_FAULT))
    kinds = [*KINDS, *(rng.choice(list(KINDS)) for _ in range(count - len(KINDS)))]
    rng.shuffle(kinds)
    return kinds


def two_ranks(cli, timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(ranks := _ranks(cli.pid)) < 2:
        assert cli.poll() is None and time.monotonic() < deadline, "no 2 trainer ranks"
        time.sleep(0.1)
    return ranks


def wait_restarted(cli, out: Path, old: list[int], t_fault: float, timeout_s: float = 300) -> tuple[float, int]:
    """After a rank fault: (seconds from `t_fault` to the first trainer step of the restarted attempt, steps
    rolled back). The attempt counts as restarted when two rank processes other than `old` run."""
    last = _trained_steps(out)
    deadline = time.monotonic() + timeout_s
    while len(new := [p for p in _ranks(cli.pid) if p not in old]) < 2:
        assert cli.poll() is None and time.monotonic() < deadline, f"the ranks were not replaced in {timeout_s}s"
        last = max(last, _trained_steps(out))
        time.sleep(0.1)
    started = time.time()
    while not stepped_since(out, started, last):
        assert cli.poll() is None and time.monotonic() < deadline, f"no step after the restart in {timeout_s}s ({new})"
        time.sleep(0.1)
    return time.monotonic() - t_fault, last - resume_point(out, last)


def _inject(cli, out: Path, kind: str, rng: random.Random, t0: float, snapshots: dict) -> FaultRecord | None:
    if not _wait_for_progress(cli, out, _checkpoints(out), timeout_s=300):
        return None  # the run finished first
    time.sleep(rng.uniform(0.0, 1.0))  # anywhere in a step
    ranks = two_ranks(cli)
    victim = rng.randrange(len(ranks))
    snapshots.update(_committed_rollouts(out))
    t_fault = time.monotonic()
    os.kill(ranks[victim], KINDS[kind])
    recover_s, rolled = wait_restarted(cli, out, ranks, t_fault)
    return FaultRecord(kind, t_fault - t0, recover_s, rolled, f"rank {victim} of 2")


def segment(workdir: Path, seed: int, minutes: float, *, api: str | None = None) -> SegmentResult:
    """The ranks segment; `api`: a Prefect API to report to (without one the CLI starts its own)."""
    t0, rng = time.monotonic(), random.Random(seed)
    kinds = schedule(rng, minutes)
    steps = 2 + STEPS_PER_FAULT * (len(kinds) + 1)
    result = SegmentResult(name=f"ranks-{seed}", profile="tiny-cpu-fsdp2", steps=steps, wall_s=0.0)
    out, log = workdir / "runs" / "ranks", workdir / "ranks.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ("rl", "@", str(FSDP2), "@", str(RESUME), "--max-steps", str(steps), "--restart.max-restarts", "8", *STALL)
    cli = start_cli(workdir, log, api, *args, "--output-dir", str(out))
    snapshots: dict[int, str] = {}
    try:
        for kind in kinds:
            record = _inject(cli, out, kind, rng, t0, snapshots)
            if record is None:
                result.problems.append(f"the run ended before the {kind} fault")
                break
            result.faults.append(record)
        assert cli.wait(timeout=900) == 0, log.read_text()[-4000:]
        _assert_nothing_lost_or_duplicated(out, steps, snapshots)
        _wait_gone(out)
    except Exception as exc:  # noqa: BLE001 - the driver gets a result that names what failed
        result.problems.append(f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    result.wall_s = time.monotonic() - t0
    return result
