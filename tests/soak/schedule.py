"""Run one soak segment: a real `rollflow rl` under a seeded random fault schedule, one fault at a time, each
followed by a bounded wait for recovery (a step recorded by the trainer after the fault), then the audit.

    faults = soak(ctx, kinds, quick, deadline, max_steps)   # FaultRecord per injected fault
    wall_s = finish(ctx, max_steps)                          # the run carried to its end (resumed if it stopped)

Recovery of a fault that restarts the attempt counts only once a trainer process other than the one before the
fault records a step; rolled_back is the trained steps recorded before the fault minus the fewest seen after it
(the resume point).
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.integration.conftest import component_pid
from tests.soak.audit import committed_rollouts
from tests.soak.faults import Ctx, injector
from tests.soak.record import FaultRecord

RECOVER_S = 300.0  # a fault not recovered in this long is reported as never recovered
MAX_DRIVER_RESUMES = 5  # per fault: a run that keeps stopping is a finding, not something to retry forever


def plan(ctx: Ctx, kinds: list[str], quick: bool) -> list[str]:
    """quick: one fault of each class (sigkill, sigstop, ...) with a random target, shuffled; else every kind once
    in a seeded random order (the caller draws round after round until its deadline), so a soak long enough for a
    round covers every kind."""
    if not quick:
        return ctx.rng.sample(kinds, len(kinds))
    classes: dict[str, list[str]] = {}
    for kind in kinds:
        classes.setdefault(kind.split(":")[0], []).append(kind)
    picked = [ctx.rng.choice(options) for options in classes.values()]
    ctx.rng.shuffle(picked)
    return picked


def _restart_if_stopped(ctx: Ctx, notes: list[str]) -> bool:
    """A run that stopped with an error is resumed by the driver (noted); True when it finished."""
    rc = ctx.run.cli.poll()
    if rc is None:
        return False
    if rc == 0:
        return True
    notes.append(f"the flow exited with rc {rc}; the driver resumed it")
    ctx.run.wait_gone()
    ctx.run.resume()
    return False


def recover(ctx: Ctx, t0: float, old_trainer: int | None) -> tuple[float | None, int, str]:
    """(seconds from t0 to the first step recorded after the fault or None, fewest rows seen, notes)."""
    run, notes, resumes = ctx.run, [], 0
    low = run.progress()[0]
    t_ref = None if old_trainer else time.time()
    while time.monotonic() - t0 < RECOVER_S and resumes <= MAX_DRIVER_RESUMES:
        if run.cli.poll() is not None:
            resumes += 1
            if _restart_if_stopped(ctx, notes):
                return time.monotonic() - t0, low, "; ".join(notes + ["the run finished"])
        if t_ref is None and (pid := component_pid(run.cli.pid, "trainer")) and pid != old_trainer:
            t_ref = time.time()
        rows, last = run.progress()
        low = min(low, rows)
        if t_ref is not None and last > t_ref:
            return time.monotonic() - t0, low, "; ".join(notes)
        time.sleep(0.5)
    return None, low, "; ".join(notes + ["NOT recovered"])


def inject(ctx: Ctx, kind: str, t_start: float) -> FaultRecord:
    run = ctx.run
    if not run.out.startswith("s3://"):
        ctx.snapshots.update(committed_rollouts(Path(run.out)))
    before, _ = run.progress()
    old_trainer = component_pid(run.cli.pid, "trainer")
    t0 = time.monotonic()
    note, restarts = injector(kind)(ctx)
    recover_s, low, more = recover(ctx, t0, old_trainer if restarts else None)
    if recover_s is None:
        ctx.problems.append(f"{kind} at {t0 - t_start:.0f} s was not recovered in {RECOVER_S:.0f} s")
    rolled_back = max(0, before - low)
    note = f"{note}; {more}" if more else note
    return FaultRecord(kind, round(t0 - t_start, 1), recover_s and round(recover_s, 1), rolled_back, note)


def _wait_steps(ctx: Ctx, steps: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while ctx.run.progress()[0] < steps and time.monotonic() < deadline:
        if ctx.run.cli.poll() is not None and _restart_if_stopped(ctx, []):
            return
        time.sleep(0.5)


def soak(ctx: Ctx, kinds: list[str], quick: bool, deadline: float, max_steps: int) -> list[FaultRecord]:
    """Faults one after the other until `deadline` (monotonic) or, quick, one of each class; never in the last
    few steps (a fault must have a step after it to recover into)."""
    t_start, records = time.monotonic(), []
    _wait_steps(ctx, 2, 600)
    todo = plan(ctx, kinds, quick) if quick else []
    while (todo if quick else time.monotonic() < deadline) and ctx.run.cli.poll() is None:
        # progress between faults (a run that only recovers trains nothing), then a random moment in a step
        _wait_steps(ctx, ctx.run.progress()[0] + ctx.rng.randint(*((1, 3) if quick else (2, 8))), 120)
        time.sleep(ctx.rng.uniform(0.0, 1.5))
        if ctx.run.progress()[0] >= max_steps - 3:
            break
        if not todo:  # quick never gets here empty; a long soak starts its next round
            todo = plan(ctx, kinds, False)
        kind = todo.pop(0)
        records.append(inject(ctx, kind, t_start))
        r = records[-1]
        print(
            f"  {r.at_s:7.1f}s {r.kind:22} recovered in {r.recover_s}s, {r.rolled_back} rolled back: {r.note}",
            flush=True,
        )
    return records


def finish(ctx: Ctx, max_steps: int, timeout_s: float) -> None:
    """Carry the run to its end (resuming it when it stops with an error), bounded by `timeout_s`."""
    deadline, notes = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and len(notes) <= MAX_DRIVER_RESUMES:
        if ctx.run.cli.poll() is not None and _restart_if_stopped(ctx, notes):
            break
        time.sleep(0.5)
    else:
        ctx.problems.append(f"the run did not finish its {max_steps} steps in {timeout_s:.0f} s ({notes})")
    ctx.problems.extend(f"at the end: {n}" for n in notes)
