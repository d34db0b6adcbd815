"""Tenants come and go on one shared deployment while the others run (docs/multitenant.md, issue 27's lifecycle):
three tenant runs with different environments and LoRA settings on one `rollflow shared up`, through the real
CLI and processes:

    A (reverse-text, rank 8, every projection) and B (sort-letters, rank 4, q/v) start together
    -> C (tool-lookup, multi-turn, rank 2, o/down) joins once A and B trained a step
    -> A's whole process tree is SIGKILLed mid-run; B and C must keep training through A's outage
    -> `rollflow resume A --tenant-of D` brings A back from its last checkpoint
    -> B (the shortest) finishes while A and C still run; A and C finish; every lake passes the resume audit.

Outage and step counts come from the tenants' own metrics.jsonl (each row's `time`); they are printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from shared_deploy import (
    TENANT,
    Deployment,
    check_tenant,
    kill_tree,
    shared_deployment,
    shut_down,
    step_times,
    wait_until,
    write_profile,
)
from test_resume import _checkpoints, _committed_rollouts

pytestmark = pytest.mark.long
# Measured here: a tenant step takes ~1.5-2.5 s, a tenant flow ~30 s from its start to its first trained step
# (A and B trained ~20 steps before C's first); A's outage ~35 s. Enough steps that all three overlap, B (the
# shortest) still trains through A's outage and ends before A and C.
STEPS = {"tenant-a": 60, "tenant-b": 40, "tenant-c": 50}
PROFILES = {
    "tenant-a": '[model.lora]\nrank = 8\nalpha = 16.0\n[[envs]]\nname = "reverse-text"\nmin_chars = 3\nmax_chars = 6\n',
    "tenant-b": '[model.lora]\nrank = 4\nalpha = 8.0\ntarget_modules = ["q_proj", "v_proj"]\n'
    '[[envs]]\nname = "sort-letters"\nmin_chars = 3\nmax_chars = 6\n',
    "tenant-c": '[model.lora]\nrank = 2\nalpha = 4.0\ntarget_modules = ["o_proj", "down_proj"]\n'
    '[[envs]]\nid = "tool-lookup"\nargs = { min_chars = 2, max_chars = 4 }\n',
}


def _steps_after(out: Path, t: float, until: float = float("inf")) -> int:
    return sum(1 for _, when in step_times(out) if t < when < until)


def _joined(out: dict[str, Path]) -> bool:
    return bool(step_times(out["tenant-c"]) and _checkpoints(out["tenant-a"]))


def _record(dep: Deployment, name: str) -> dict:
    try:
        return json.loads((dep.dir / "tenants" / f"{name}.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _finish_all(dep: Deployment, clis: dict[str, subprocess.Popen], timeout_s: float = 600.0) -> dict[str, float]:
    """Wait for every run to end (each must exit 0); returns when each ended (time.time())."""
    ended: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(clis):
        for name, cli in clis.items():
            if name not in ended and cli.poll() is not None:
                assert cli.returncode == 0, dep.tail(name)
                ended[name] = time.time()
        assert time.monotonic() < deadline, f"runs still going after {timeout_s}s: {set(clis) - set(ended)}"
        time.sleep(0.2)
    return ended


def test_three_tenants_join_get_killed_resume_and_finish_while_others_run(tmp_path, prefect_api):
    profiles = {n: [*TENANT, write_profile(tmp_path / f"{n}.toml", f"max_steps = {STEPS[n]}\n{p}")]
                for n, p in PROFILES.items()}  # fmt: skip
    out = {n: tmp_path / n for n in STEPS}
    with shared_deployment(tmp_path, prefect_api) as dep:
        t0 = time.time()
        clis = {n: dep.tenant(n, profiles[n]) for n in ("tenant-a", "tenant-b")}
        try:
            wait_until("A and B trained a step", lambda: all(step_times(out[n]) for n in clis), clis, dep)
            clis["tenant-c"] = dep.tenant("tenant-c", profiles["tenant-c"])
            t_c = time.time()
            wait_until("C trained a step and A checkpointed", lambda: _joined(out), clis, dep)
            attempt = _record(dep, "tenant-a")["attempt"]
            snapshots = _committed_rollouts(out["tenant-a"])
            t_kill = time.time()
            kill_tree(clis.pop("tenant-a"), out["tenant-a"])
            at_kill = {n: len(step_times(o)) for n, o in out.items()}
            # The others keep training while A is dead (the shared trainer holds A, waiting for its rollouts).
            others = ("tenant-b", "tenant-c")
            wait_until("B and C trained during A's outage",
                        lambda: all(_steps_after(out[n], t_kill) for n in others), {}, dep, 180)  # fmt: skip
            t_resume = time.time()
            clis["tenant-a"] = dep.resume("tenant-a")
            wait_until("A's resume registered", lambda: _record(dep, "tenant-a").get("attempt", 0) > attempt,
                        {"tenant-a": clis["tenant-a"]}, dep)  # fmt: skip
            t_attached = time.time()  # the resume holds A's lease now: A's old attempt can write nothing more
            ckpt = _record(dep, "tenant-a")["resume_step"]
            assert ckpt == _checkpoints(out["tenant-a"])[-1]  # from its newest checkpoint
            wait_until("A trained again", lambda: _steps_after(out["tenant-a"], t_attached) > 0, {}, dep)
            t_back = min(t for _, t in step_times(out["tenant-a"]) if t > t_attached)
            ended = _finish_all(dep, clis)
        finally:
            for cli in clis.values():
                if cli.poll() is None:
                    os.killpg(cli.pid, signal.SIGKILL)
                    cli.wait()
        during = {n: _steps_after(out[n], t_kill, t_back) for n in others}
        assert all(during.values()), during
        assert ended["tenant-b"] < min(ended["tenant-a"], ended["tenant-c"])  # B finished while A and C ran
        a_rows = step_times(out["tenant-a"])
        # the old attempt's steps up to the checkpoint are kept (the shared trainer may have trained some of them
        # after the kill, from rollouts already committed), every later one is the resumed attempt's
        assert [s for s, t in a_rows if t < t_attached] == list(range(1, ckpt + 1))
        assert [s for s, t in a_rows if t > t_attached] == list(range(ckpt + 1, STEPS["tenant-a"] + 1))  # trained again
        for n in STEPS:
            check_tenant(out[n], dep.record["backbone_sha256"], STEPS[n], snapshots if n == "tenant-a" else None)
        assert list((dep.dir / "tenants").glob("*.json")) == []
        shut_down(dep)
    ends = ", ".join(f"{n} +{t - t0:.0f}s" for n, t in ended.items())
    print(f"deployment up in {dep.up_s:.0f}s; C joined at +{t_c - t0:.0f}s; A killed at +{t_kill - t0:.0f}s "
          f"(steps then {at_kill}), resumed from step {ckpt} at +{t_resume - t0:.0f}s; A trained again "
          f"{t_back - t_kill:.1f}s after the kill; steps during A's outage {during}; ended at {ends}")  # fmt: skip
