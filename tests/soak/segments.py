"""The soak's segments: each runs one profile under one fault schedule and returns a SegmentResult.

    dense_local   profiles/tiny-cpu.toml @ tests/profiles/soak.toml, its output_dir on a tmpfs the segment mounts
                  (a full disk is one of its faults): kills, stops, corruption, a second resume, a full disk
    dense_s3      the same run with its output_dir on moto S3 behind the FaultProxy: outages of 20-40 s (ridden
                  out by the storage retries: storage.retry_budget_s 120) between kills of the flow and the tree
    moe, multiturn  profiles/tiny-moe-cpu.toml and profiles/tiny-tools-cpu.toml: a shorter schedule of kills,
                  stops and a corrupt checkpoint

A segment is a callable (workdir, seed, minutes) -> SegmentResult; tests/soak/__main__.py runs a list of them.
Bounds: `minutes` is when the segment stops injecting; the run then finishes its max_steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from tests.integration.conftest import start_cli
from tests.s3util import BUCKET, CREDENTIALS, FaultProxy, moto_s3
from tests.soak.audit import audit_run
from tests.soak.faults import Ctx
from tests.soak.memory import MemorySampler
from tests.soak.record import SegmentResult
from tests.soak.run import Run
from tests.soak.schedule import finish, soak

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "tests" / "profiles" / "soak.toml"
COMPONENTS = ("trainer", "orchestrator", "inference")
KILLS = [f"sigkill:{t}" for t in (*COMPONENTS, "flow", "tree")]
STOPS = [f"sigstop:{t}" for t in COMPONENTS]
CORRUPT = [f"corrupt:{w}" for w in ("shard", "publication", "checkpoint")]
LOCAL_KINDS = [*KILLS, *STOPS, *CORRUPT, "resume:second", "disk:full"]
# stall timeouts above the longest outage: a component waiting on storage is not stuck
S3_FLAGS = ("--storage.timeout_s", "2", "--storage.retry_budget_s", "120", "--storage.retry_max_attempts", "1000",
            "--storage.retry_max_backoff_s", "2", "--restart.lease_ttl_s", "120",
            *(f"--restart.stall.{c}-s" for c in COMPONENTS[:1]), "90", "--restart.stall.orchestrator-s", "90",
            "--restart.stall.inference-s", "90")  # fmt: skip


def steps_for(minutes: float) -> int:
    """Trained steps enough to keep injecting faults for `minutes`: on an idle 2-core machine the dense run trains
    ~36 steps a minute between its faults, on a loaded one ~12. Sized for the fast case, so the schedule never runs
    out of steps before its deadline; on a slow machine the run then trains its remaining steps without faults.
    (The faults stop `max_steps - 3` steps before the end: a fault needs a step after it to recover into.)"""
    return max(40, int(minutes * 40))


def _api() -> str | None:
    return os.environ.get("PREFECT_API_URL")


def _stale_bound(out: Path) -> int:
    try:
        return int(json.loads((out / "config" / "run.json").read_text())["max_off_policy_steps"])
    except (OSError, ValueError, KeyError):
        return 2


def run_local(name: str, profiles: list[Path], workdir: Path, out: Path, seed: int, minutes: float, kinds: list[str],
              quick: bool, disk: Path | None = None, extra: tuple[str, ...] = ()) -> SegmentResult:  # fmt: skip
    """One local run under the schedule: start, soak, finish, audit; memory sampled throughout."""
    args = tuple(a for p in profiles for a in ("@", str(p))) + extra
    max_steps = 60 if quick else steps_for(minutes)
    run = Run(workdir, str(out), (*args, "--max-steps", str(max_steps), "--seed", str(seed)), _api(), LocalFileSystem())
    ctx = Ctx(run, random.Random(seed), disk=disk)
    if quick:
        ctx.disk_hold_s = 8.0
    t0 = time.monotonic()
    run.start()
    try:
        with MemorySampler(lambda: run.cli.pid, lambda: run.progress()[0], every_s=5.0 if quick else 10.0) as mem:
            faults = soak(ctx, kinds, quick, t0 + minutes * 60, max_steps)
            finish(ctx, max_steps, timeout_s=max_steps * 6 + 300)
    finally:
        run.stop()
    wall = time.monotonic() - t0
    problems = ctx.problems + audit_run(out, max_steps, ctx.snapshots, _stale_bound(out), every_weight=False)
    result = SegmentResult(name, " @ ".join(str(p.relative_to(ROOT)) for p in profiles), max_steps, round(wall, 1),
                           faults, problems, mem.first_last())  # fmt: skip
    result.rss_slope_kb_per_step = mem.slopes_kb_per_step()
    result.seed = seed
    return result


def fault_free_wall(profiles: list[Path], workdir: Path, max_steps: int, seed: int) -> float:
    """Seconds a run of the same profile and steps takes without faults (start-up included, as in the soak)."""
    out = workdir / "fault-free"
    args = [a for p in profiles for a in ("@", str(p))]
    t0 = time.monotonic()
    cli = start_cli(workdir, workdir / "fault-free.log", _api(), "rl", *args, "--max-steps", str(max_steps),
                    "--seed", str(seed), "--output-dir", str(out))  # fmt: skip
    cli.wait(timeout=max_steps * 6 + 300)
    return round(time.monotonic() - t0, 1)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A size-limited tmpfs at `path` (we are root), unmounted (lazily if still busy) on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, timeout=30)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], timeout=60)


def dense_local(workdir: Path, seed: int, minutes: float, quick: bool = False, baseline: bool = True) -> SegmentResult:
    profiles = [ROOT / "profiles" / "tiny-cpu.toml", SOAK]
    with tmpfs(workdir / "disk", "256m") as disk:
        result = run_local("dense-local", profiles, workdir, disk / "run", seed, minutes, LOCAL_KINDS, quick, disk)
    if baseline and not quick:
        result.fault_free_wall_s = fault_free_wall(profiles, workdir, result.steps, seed)
    return result


def moe(workdir: Path, seed: int, minutes: float) -> SegmentResult:
    profiles = [ROOT / "profiles" / "tiny-moe-cpu.toml", SOAK]
    kinds = [*KILLS, *STOPS, "corrupt:checkpoint"]
    return run_local("moe", profiles, workdir, workdir / "run", seed, minutes, kinds, False)


def multiturn(workdir: Path, seed: int, minutes: float) -> SegmentResult:
    profiles = [ROOT / "profiles" / "tiny-tools-cpu.toml", SOAK]
    kinds = [*KILLS, *STOPS, "corrupt:checkpoint"]
    return run_local("multi-turn", profiles, workdir, workdir / "run", seed, minutes, kinds, False,
                     extra=("--orchestrator.batch_size", "6"))  # fmt: skip


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dense_s3(workdir: Path, seed: int, minutes: float) -> SegmentResult:
    """The dense run with its output_dir on moto S3 behind the FaultProxy; audited on a copy fetched after it."""
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    profiles = [ROOT / "profiles" / "tiny-cpu.toml", SOAK]
    kinds = ["s3:outage", "s3:outage", "sigkill:flow", "sigkill:tree", "sigkill:trainer"]
    args = (*(a for p in profiles for a in ("@", str(p))), *S3_FLAGS)
    max_steps, out = steps_for(minutes), f"s3://{BUCKET}/soak-{seed}"
    with moto_s3() as endpoint, FaultProxy(endpoint, stall_s=5.0) as proxy:
        direct = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                   client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})  # fmt: skip
        with _environ({**CREDENTIALS, "AWS_ENDPOINT_URL": proxy.url}):
            run = Run(workdir, out, (*args, "--max-steps", str(max_steps), "--seed", str(seed)), _api(), direct)
            ctx = Ctx(run, random.Random(seed), proxy=proxy)
            t0 = time.monotonic()
            run.start()
            try:
                with MemorySampler(lambda: run.cli.pid, lambda: run.progress()[0]) as mem:
                    faults = soak(ctx, kinds, False, t0 + minutes * 60, max_steps)
                    finish(ctx, max_steps, timeout_s=max_steps * 6 + 300)
            finally:
                proxy.heal()
                run.stop()
            wall = time.monotonic() - t0
        copy = workdir / "s3-copy"
        direct.get(f"{BUCKET}/soak-{seed}", str(copy), recursive=True)
    problems = ctx.problems + audit_run(copy, max_steps, {}, _stale_bound(copy), every_weight=False)
    result = SegmentResult("dense-s3", " @ ".join(str(p.relative_to(ROOT)) for p in profiles), max_steps,
                           round(wall, 1), faults, problems, mem.first_last())  # fmt: skip
    result.rss_slope_kb_per_step, result.seed = mem.slopes_kb_per_step(), seed
    return result
