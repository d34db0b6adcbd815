"""K LoRA tenants on one shared deployment vs the same K profiles as K standalone runs (issue 27, docs/multitenant.md).

`python -m tests.bench.multitenant [--quick] [--learn] [--steps N]` prints a markdown section; `run(workspace)`
returns it for `python -m tests.bench`. Everything goes through the real CLI, one local Prefect API serving every
command (it is left out of the memory sums: both setups would share it alike):

1. `rollflow shared up @ tiny-cpu.toml @ tiny-cpu-shared.toml` (a 40-step warm-up) publishes the backbone;
2. for K = 2, then 3, interleaved (shared K, standalone K): K tenant runs started at once with
   `rollflow rl @ tiny-cpu-lora.toml @ <tenant> --tenant-of D`, then the same K profiles started at once as
   standalone `rollflow rl` runs whose version 0 is a checked copy of the same backbone (runtime.tenancy's
   copy_backbone, the run opened first and then started with `--resume`, so no warm-up runs and both setups
   learn from the same weights with the same seeds);
3. `rollflow shared down`.

While a setup runs, the PSS of every process of it is sampled every 0.2 s (tests/bench/memory.py: the K CLIs'
trees, plus the deployment's tree for the shared setup) and its peak sum is the setup's memory. From each run's
metrics.jsonl: completion tokens (samples x completion_len_mean) summed over every step of every tenant, over
the setup's whole wall time (all K started -> the last one exited) is the aggregate throughput; a tenant's step
time is the median interval between its consecutive steps' `time`; its learning is the mean reward of its first
n steps against its last n (n = 5, or steps // 2 when fewer).

`--learn` (K = 3 only, default 50 steps): the tenants keep tiny-cpu-lora's batch (32 prompts x 8 samples) and the
deployment its full 200-step warm-up, the shape tiny-cpu-lora is known to learn with (docs/benchmarks.md, LoRA),
and a "Learning" table follows: per tenant the reward rise, shared vs standalone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.bench import harness, memory

TITLE = "Multi-tenant LoRA: K tenants on one deployment vs K standalone runs (tests/bench/multitenant.py)"
BASE = [harness.ROOT / "profiles/tiny-cpu.toml", harness.ROOT / "profiles/tiny-cpu-shared.toml"]
TENANT = harness.ROOT / "profiles/tiny-cpu-lora.toml"
KS = (2, 3)
STEPS = 20  # per run in full mode: first 5 vs last 5 rewards
LEARN_STEPS = 50  # per run with --learn: 20 steps of 32 samples show no rise, tiny-cpu-lora rises over 50-100
UP_TIMEOUT_S = 600.0
# Three different tenants: environments, LoRA rank and targets differ (tenant-a is tiny-cpu-lora as it is).
TENANTS = {
    "tenant-a": "",
    "tenant-b": '[model.lora]\nrank = 4\nalpha = 8.0\n[[envs]]\nname = "sort-letters"\nmin_chars = 3\nmax_chars = 6\n',
    "tenant-c": '[model.lora]\nrank = 8\nalpha = 16.0\ntarget_modules = ["q_proj", "v_proj", "o_proj"]\n'
    '[[envs]]\nname = "reverse-text"\nmin_chars = 3\nmax_chars = 6\n',
}
# What each tenant is, for the learning table: (environments, LoRA settings); seeds are 0, 1, 2 in order.
DESCRIBE = {
    "tenant-a": ("reverse-text + sort-letters, 3-8 chars", "rank 8, alpha 16, every projection"),
    "tenant-b": ("sort-letters, 3-6 chars", "rank 4, alpha 8, every projection"),
    "tenant-c": ("reverse-text, 3-6 chars", "rank 8, alpha 16, q/v/o only"),
}


def _deployment_toml(steps: int, learn: bool) -> str:
    warmup = "" if learn else "[sft]\nsteps = 40\n"  # --learn: tiny-cpu's 200 steps, the base tiny-cpu-lora learns on
    return _workload(steps, learn) + warmup + "[shared]\nmax_tenants = 4\nmax_lora_rank = 8\npoll_s = 0.2\n"


def _workload(steps: int, learn: bool) -> str:
    """Every tenant's and standalone run's shape: short steps so K runs fit the machine at once (with --learn,
    tiny-cpu-lora's own batch: 32 prompts x 8 samples)."""
    batch = "" if learn else "[orchestrator]\nbatch_size = 8\ngroup_size = 4\n"
    return f"max_steps = {steps}\n{batch}[checkpoint]\ninterval = {steps}\n[tracking]\nmlflow = false\n"


@dataclass
class Tenant:
    name: str
    out: Path
    step_s: float  # median interval between consecutive steps
    tokens: float  # completion tokens over every step
    steady: tuple[float, float, float]  # (time of step 1, time of the last step, tokens of steps 2..N)
    rewards: list[float]  # reward_mean of every step
    reward_first: float
    reward_last: float


@dataclass
class Setup:
    k: int
    shared: bool
    wall_s: float
    peak_mb: float
    tenants: list[Tenant]
    load: tuple[float, float, float]  # after
    load_before: tuple[float, float, float]

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens for t in self.tenants) / self.wall_s

    @property
    def steady_tokens_per_s(self) -> float:
        """Steps 2..N of every run over the first step 1 done -> the last step done: start-up left out."""
        t0, t1 = min(t.steady[0] for t in self.tenants), max(t.steady[1] for t in self.tenants)
        return sum(t.steady[2] for t in self.tenants) / (t1 - t0)


def _env(api_url: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(harness.ROOT)}


def _cli(api_url: str, log: Path, *args: str) -> subprocess.Popen:
    """The CLI in a session of its own, so its whole tree can be stopped."""
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "rollflow.cli", *args], env=_env(api_url), stdout=f,
                                stderr=subprocess.STDOUT, cwd=harness.ROOT, start_new_session=True)  # fmt: skip


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _profiles(work: Path, name: str, steps: int, learn: bool) -> list[Path]:
    own = work / f"{name}.toml"
    own.write_text(f"seed = {list(TENANTS).index(name)}\n" + _workload(steps, learn) + TENANTS[name])
    return [TENANT, own]


def _open_standalone(profiles: list[Path], out: Path, deploy: Path) -> None:
    """A standalone run opened as `rollflow rl` opens one (config/run.json, state.json), its version 0 a checked
    copy of the deployment's backbone: `rollflow rl --resume` then starts at step 1 with no warm-up."""
    from config.loader import load_run_config
    from runtime.lifecycle import start_new_run
    from runtime.tenancy import copy_backbone
    from storage.fs import get_fs
    from storage.tenants import read_deployment

    start_new_run(load_run_config(profiles, [("output_dir", str(out))]), overwrite=False)
    fs, root = get_fs(str(out))
    copy_backbone(str(deploy), read_deployment(str(deploy)), fs, root)


def _wait_up(deploy: Path, up: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"`rollflow shared up` exited {up.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if json.loads((deploy / "shared_state.json").read_text()).get("state") == "up":
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the deployment was not up in {UP_TIMEOUT_S:.0f}s:\n{log.read_text()[-3000:]}")


def _read_tenant(name: str, out: Path, steps: int) -> Tenant:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in rows if "reward_mean" in r}  # a resumed step's last row counts
    rows = [by_step[s] for s in sorted(by_step)]
    if len(rows) != steps:
        raise RuntimeError(f"{out}: {len(rows)} steps in metrics.jsonl, expected {steps}")
    times = [r["time"] for r in rows]
    n = min(5, steps // 2)
    return Tenant(
        name,
        out,
        statistics.median(b - a for a, b in zip(times, times[1:], strict=False)),
        sum(r["samples"] * r["completion_len_mean"] for r in rows),
        (times[0], times[-1], sum(r["samples"] * r["completion_len_mean"] for r in rows[1:])),
        [r["reward_mean"] for r in rows],
        statistics.mean(r["reward_mean"] for r in rows[:n]),
        statistics.mean(r["reward_mean"] for r in rows[-n:]),
    )


def _run_setup(work: Path, api_url: str, k: int, steps: int, deploy: Path, up_pid: int | None, learn: bool) -> Setup:
    """K runs started at once (tenants of `deploy`, or standalone from its backbone), sampled until all exit."""
    kind = "shared" if up_pid is not None else "standalone"
    root = work / f"{kind}-{k}"
    root.mkdir()
    names = list(TENANTS)[:k]
    argvs = []
    for name in names:
        out = root / name
        profiles = _profiles(root, name, steps, learn)
        argv = ["rl", *(t for p in profiles for t in ("@", str(p))), "--output-dir", str(out)]
        if up_pid is not None:
            argv += ["--tenant-of", str(deploy), "--tenant", name]
        else:
            _open_standalone(profiles, out, deploy)
            argv += ["--resume"]
        argvs.append(argv)
    t0, load_before = time.monotonic(), os.getloadavg()
    procs = [_cli(api_url, root / f"{name}.log", *argv) for name, argv in zip(names, argvs, strict=True)]
    try:
        sampled = memory.sample_trees(procs, 300.0 + 60.0 * steps * k, also=[up_pid] if up_pid else [])
    finally:
        _kill(procs)
    wall = time.monotonic() - t0
    for name, p in zip(names, procs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"{kind} {name} exited {p.returncode}:\n{(root / f'{name}.log').read_text()[-3000:]}")
    tenants = [_read_tenant(name, root / name, steps) for name in names]
    return Setup(k, up_pid is not None, wall, sampled.peak_total_mb, tenants, os.getloadavg(), load_before)


def measure(work: Path, steps: int, learn: bool = False) -> tuple[list[Setup], float]:
    """Every setup, interleaved (shared 2, standalone 2, shared 3, standalone 3; with --learn only the 3s); and the
    deployment's up time."""
    from runtime.local_api import local_prefect_api

    deploy, base = work / "deploy", work / "deployment.toml"
    base.write_text(_deployment_toml(steps, learn))
    setups = []
    with local_prefect_api(timeout_s=180.0) as api_url:
        t0 = time.monotonic()
        up = _cli(api_url, work / "up.log", "shared", "up", *(t for p in [*BASE, base] for t in ("@", str(p))),
                  "--deploy-dir", str(deploy))  # fmt: skip
        try:
            _wait_up(deploy, up, work / "up.log")
            up_s = time.monotonic() - t0
            for k in KS[-1:] if learn else KS:
                print(f"[multitenant] K={k} shared ...", flush=True)
                setups.append(_run_setup(work, api_url, k, steps, deploy, up.pid, learn))
                print(f"[multitenant] K={k} standalone ...", flush=True)
                setups.append(_run_setup(work, api_url, k, steps, deploy, None, learn))
            down = subprocess.run([sys.executable, "-m", "rollflow.cli", "shared", "down", str(deploy)],
                                  env=_env(api_url), capture_output=True, text=True, timeout=120)  # fmt: skip
            if down.returncode != 0:
                raise RuntimeError(f"`rollflow shared down` exited {down.returncode}: {down.stderr[-2000:]}")
            up.wait(timeout=90)
        finally:
            _kill([up])
    return setups, up_s


def _fmt(v: float, digits: int = 3) -> str:
    return harness.num(v, digits)


def _rows(setups: list[Setup]) -> list[list[str]]:
    rows = []
    for s in setups:
        rows.append([
            f"{s.k} {'tenants, shared' if s.shared else 'standalone runs'}",
            f"{_fmt(s.wall_s)} s",
            _fmt(s.tokens_per_s),
            _fmt(s.steady_tokens_per_s),
            " / ".join(f"{_fmt(t.step_s)} s" for t in s.tenants),
            f"{s.peak_mb:,.0f}",
            " / ".join(f"{t.reward_first:.3f} -> {t.reward_last:.3f}" for t in s.tenants),
            " / ".join(f"{x:.2f}" for x in s.load),
        ])  # fmt: skip
    return rows


def _ratio_rows(setups: list[Setup]) -> list[list[str]]:
    rows = []
    for k in sorted({s.k for s in setups}):
        sh, al = (next(s for s in setups if s.k == k and s.shared is flag) for flag in (True, False))
        steps = [a.step_s / b.step_s for a, b in zip(sh.tenants, al.tenants, strict=True)]
        diff = max(
            abs(x - y)
            for a, b in zip(sh.tenants, al.tenants, strict=True)
            for x, y in zip(a.rewards, b.rewards, strict=True)
        )
        rows.append([
            str(k),
            f"{sh.tokens_per_s / al.tokens_per_s:.2f}x",
            f"{sh.steady_tokens_per_s / al.steady_tokens_per_s:.2f}x",
            f"{sh.wall_s / al.wall_s:.2f}x",
            " / ".join(f"{r:.2f}x" for r in steps),
            f"{al.peak_mb - sh.peak_mb:,.0f} MB ({1 - sh.peak_mb / al.peak_mb:.0%})",
            f"{diff:.2g}",
        ])  # fmt: skip
    return rows


def _learning(setups: list[Setup], n: int) -> str:
    """The --learn table: per tenant its reward's first-n and last-n means, shared vs standalone."""
    sh, al = (next(s for s in setups if s.shared is flag) for flag in (True, False))
    rows = []
    for i, (a, b) in enumerate(zip(sh.tenants, al.tenants, strict=True)):
        env, lora = DESCRIBE[a.name]
        rows.append([a.name, env, lora, str(i)] + [
            f"{t.reward_first:.3f} -> {t.reward_last:.3f} ({t.reward_last - t.reward_first:+.3f})" for t in (a, b)
        ])  # fmt: skip
    cols = ["tenant", "env", "LoRA", "seed", f"shared: reward first {n} -> last {n} (rise)",
            f"standalone: reward first {n} -> last {n} (rise)"]  # fmt: skip
    return f"Learning\n\n{harness.table(cols, rows)}\n"


def render(setups: list[Setup], up_s: float, steps: int, total_s: float, learn: bool = False) -> str:
    n = min(5, steps // 2)
    load = " / ".join(f"{x:.2f}" for x in setups[0].load_before)
    mode = "quick mode (`--quick`): smoke figures, not the full run" if harness.QUICK else "full mode"
    mode += ", learning mode (`--learn`)" if learn else ""
    shape, warmup = ("32 prompts x 8 samples", 200) if learn else ("8 prompts x 4 samples", 40)
    head = (
        f"{mode}: every setup once, {steps} RL steps per run ({shape}, `max_new_tokens = 12`), "
        f"commit {harness.commit()}, load average before the first setup {load} (1/5/15 min), "
        f"{total_s / 60:.1f} min in all (deployment up, its {warmup}-step warm-up included: {up_s:.0f} s). "
        "Tenants (`tiny-cpu-lora.toml` +): a = both envs, rank 8, seed 0; b = "
        "sort-letters, rank 4, seed 1; c = reverse-text, rank 8 on q/v/o only, seed 2. One run per setup on a "
        "shared 2-core machine: read the ratios, measured minutes apart in the same command, not the absolute times."
    )
    cols = ["setup", "wall (all started -> last exited)", "completion tokens / s (aggregate, whole wall)",
            "tokens / s, steps 2..N (first step 1 -> last step)",
            "median step time per tenant (a / b / c)", "peak PSS sum (MB)",
            f"reward first {n} -> last {n} steps (a / b / c)", "load avg after (1/5/15)"]  # fmt: skip
    ratios = ["K", "tokens / s: shared / standalone", "steps 2..N tokens / s: shared / standalone",
              "wall: shared / standalone", "step time: shared / standalone (a / b / c)",
              "memory saved by sharing", "max per-step reward difference, shared vs standalone"]  # fmt: skip
    return (
        f"{head}\n\n{harness.table(cols, _rows(setups))}\n\n{harness.table(ratios, _ratio_rows(setups))}\n\n"
        "Memory: the peak of the PSS summed over every process of the setup at one instant (the K CLI/flow "
        "processes and their components; for the shared setup also `shared up` with its inference server and "
        "trainer); the local Prefect API both setups report to is left out.\n"
        + (f"\n{_learning(setups, n)}" if learn else "")
    )


def bench(work: Path, steps: int, learn: bool = False) -> str:
    t0 = time.monotonic()
    setups, up_s = measure(work, steps, learn)
    return render(setups, up_s, steps, time.monotonic() - t0, learn)


def run(ws: harness.Workspace) -> str:
    """The section for `python -m tests.bench`."""
    work = ws.root / "multitenant"
    work.mkdir(parents=True, exist_ok=True)
    return bench(work, 4 if harness.QUICK else STEPS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.multitenant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"4 RL steps per run instead of {STEPS}: a smoke run")
    ap.add_argument("--learn", action="store_true", help="K = 3 only, tiny-cpu-lora's batch: a learning table")
    ap.add_argument(
        "--steps", type=int, help=f"RL steps per run (default {STEPS}; {LEARN_STEPS} with --learn; 4 with --quick)"
    )
    args = ap.parse_args(argv)
    harness.QUICK = args.quick
    steps = args.steps or (4 if args.quick else LEARN_STEPS if args.learn else STEPS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds: the components stop
    with tempfile.TemporaryDirectory(prefix="rollflow-multitenant-") as tmp:
        print(f"## {TITLE}\n\n{bench(Path(tmp), steps, args.learn)}", flush=True)


if __name__ == "__main__":
    main()
