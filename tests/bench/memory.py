"""Peak memory of every process of a real run, and its time to the first RL step (issue 25).

`python -m tests.bench.memory [--quick] [--steps N] [--repeats N]`: runs `rollflow rl @ profiles/tiny-cpu.toml`
(the CLI exactly as a user starts it, in a fresh output directory; `--quick`: 3 RL steps after a 20-step warm-up,
otherwise the profile's warm-up and `--steps` RL steps) and prints a markdown section. While the command runs, the
bench samples every 0.2 s the proportional set size (PSS, /proc/PID/smaps_rollup: shared pages split between
the processes sharing them, so the figures add up) of every process in the command's tree, named by its
command line (the CLI/flow process, the local Prefect API, the warm-up, inference, orchestrator, trainer, and
short-lived helpers). Reported per role: the peak PSS, and whether the process mapped libtorch (torch
imported); for the run: the peak of the sum over all processes, and the times of its phases from the process
start times (/proc/PID/stat) and the trainer's metrics.jsonl (`time` of step 1): CLI start -> warm-up start,
the warm-up, RL components start -> first RL step done (the figure compared with a peer trainer's start-up).
`run(workspace)` returns the same section for `python -m tests.bench` (a stand-alone command there, run by
`make bench-quick` only: one full run takes 2-3 minutes; the peer benchmark reports the run's memory too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.bench import harness

TITLE = "Memory per process and time to the first RL step (tests/bench/memory.py)"
PROFILE = harness.ROOT / "profiles/tiny-cpu.toml"
INTERVAL_S = 0.2
RUN_TIMEOUT_S = 900.0
ROLES = [  # (role, a substring of its command line); the first that matches names the process
    ("warm-up", "sft.json"),
    ("inference", "-m engines.inference"),
    ("orchestrator", "-m engines.orchestrator"),
    ("trainer", "-m engines.trainer"),
    ("Prefect API", "prefect.server"),
    ("MLflow bookkeeping", "-m runtime.tracking"),
    ("CLI / flow", "rollflow"),
]
TICKS = os.sysconf("SC_CLK_TCK")


def role(cmdline: str) -> str:
    return next((name for name, key in ROLES if key in cmdline), "other")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process exited between listing and reading
        return None


def _stat_fields(pid: int) -> list[str] | None:
    text = _read(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[1].split() if text else None  # after "(comm)", which may hold spaces


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat_fields(int(name))):
            children.setdefault(int(fields[1]), []).append(int(name))
    out, i = [root], 0
    while i < len(out):
        out += children.get(out[i], [])
        i += 1
    return out


def _pss_mb(pid: int) -> float | None:
    text = _read(f"/proc/{pid}/smaps_rollup")
    for line in (text or "").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return None


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime"):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


@dataclass
class Proc:
    role: str
    cmdline: str
    started: float  # wall-clock seconds (epoch), from /proc/PID/stat
    peak_mb: float = 0.0
    torch: bool = False


@dataclass
class Sampled:
    procs: dict[int, Proc] = field(default_factory=dict)
    peak_total_mb: float = 0.0


def _sample_once(roots: Sequence[int], out: Sampled, boot: float) -> None:
    """One sample of every process in the trees of `roots`, at once: their PSS sum is one setup's total."""
    total = 0.0
    for pid in dict.fromkeys(pid for root in roots for pid in _tree(root)):
        pss = _pss_mb(pid)
        if pss is None:
            continue
        total += pss
        # read every time: a child seen between fork and exec still shows its parent's command line
        cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
        proc = out.procs.get(pid)
        if proc is None:
            fields = _stat_fields(pid)
            started = boot + int(fields[19]) / TICKS if fields else time.time()
            proc = out.procs[pid] = Proc(role(cmd), cmd, started)
        elif cmd and cmd != proc.cmdline:
            proc.role, proc.cmdline = role(cmd), cmd
        proc.peak_mb = max(proc.peak_mb, pss)
        if not proc.torch:
            proc.torch = "libtorch_cpu" in (_read(f"/proc/{pid}/maps") or "")
    out.peak_total_mb = max(out.peak_total_mb, total)


def sample_tree(proc: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> Sampled:
    """Sample `proc`'s process tree every INTERVAL_S until it exits (killed after `timeout_s`)."""
    return sample_trees([proc], timeout_s)


def sample_trees(procs: Sequence[subprocess.Popen], timeout_s: float = RUN_TIMEOUT_S,
                 also: Sequence[int] = ()) -> Sampled:  # fmt: skip
    """Sample the trees of `procs` (and of the pids `also`, which may outlive them) every INTERVAL_S until
    every one of `procs` exited (all killed after `timeout_s`)."""
    out, boot, deadline = Sampled(), _boot_time(), time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise TimeoutError(f"the run(s) did not finish in {timeout_s:.0f}s")
        _sample_once([*also, *(p.pid for p in procs if p.poll() is None)], out, boot)
        time.sleep(INTERVAL_S)
    return out


@dataclass
class RunFigures:
    sampled: Sampled
    started: float  # epoch seconds when the CLI was started
    wall_s: float
    first_step: float | None  # epoch seconds when the trainer finished RL step 1 (metrics.jsonl)

    def phase(self, *roles: str) -> float | None:
        starts = [p.started for p in self.sampled.procs.values() if p.role in roles]
        return min(starts) if starts else None


def measure(output_dir: Path, steps: int, sft_steps: int | None, checkout: Path = harness.ROOT) -> RunFigures:
    """One real run of the default profile under the sampler, with the code of `checkout`."""
    profile = checkout / PROFILE.relative_to(harness.ROOT)
    argv = [sys.executable, "-m", "rollflow.cli", "rl", "@", str(profile), "--output-dir", str(output_dir),
            "--max-steps", str(steps)]  # fmt: skip
    if sft_steps is not None:
        argv += ["--sft.steps", str(sft_steps)]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)  # the CLI's own temporary Prefect API, as a user without a server gets
    log = open(output_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below, after the run
    t0 = time.time()
    with log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=checkout)
        sampled = sample_tree(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed (exit {proc.returncode}); see {log.name}")
    first = None
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == 1 and "time" in row:
            first = float(row["time"])
    return RunFigures(sampled, t0, time.time() - t0, first)


def _role_rows(runs: list[RunFigures]) -> list[list[str]]:
    rows = []
    for name in [*(n for n, _ in ROLES), "other"]:
        peaks = [max((p.peak_mb for p in r.sampled.procs.values() if p.role == name), default=None) for r in runs]
        if all(v is None for v in peaks):
            continue
        torch = any(p.torch for r in runs for p in r.sampled.procs.values() if p.role == name)
        rows.append([name, harness.Stats([v for v in peaks if v is not None]).fmt(0), "yes" if torch else "no"])
    return rows


def _time_rows(runs: list[RunFigures]) -> list[list[str]]:
    def stat(fn) -> str:  # type: ignore[no-untyped-def]
        values = [v for v in (fn(r) for r in runs) if v is not None]
        return harness.Stats(values).fmt(3, " s")

    def between(r: RunFigures, a: float | None, b: float | None) -> float | None:
        return b - a if a is not None and b is not None else None

    rl = ("inference", "orchestrator", "trainer")
    return [
        ["CLI start -> warm-up starts", stat(lambda r: between(r, r.started, r.phase("warm-up")))],
        ["warm-up (its process start -> RL components start)",
         stat(lambda r: between(r, r.phase("warm-up"), r.phase(*rl)))],
        ["RL components start -> first RL step done", stat(lambda r: between(r, r.phase(*rl), r.first_step))],
        ["CLI start -> first RL step done", stat(lambda r: between(r, r.started, r.first_step))],
        ["whole command", stat(lambda r: r.wall_s)],
    ]  # fmt: skip


def render(runs: list[RunFigures], steps: int, sft_steps: int | None, code: str) -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    warm = f"{sft_steps} warm-up steps" if sft_steps is not None else "the profile's warm-up"
    head = (
        f"`rollflow rl @ profiles/tiny-cpu.toml --max-steps {steps}` ({warm}), {len(runs)} run(s), "
        f"code: {code}, load average after (1/5/15 min) {load}. PSS sampled every {INTERVAL_S} s; "
        "a figure over runs is `median (min-max)`."
    )
    total = harness.Stats([r.sampled.peak_total_mb for r in runs]).fmt(0)
    procs = harness.table(["process", "peak PSS (MB)", "torch loaded"], _role_rows(runs))
    times = harness.table(["phase", "seconds"], _time_rows(runs))
    return f"{head}\n\nPeak of the sum over all processes: **{total} MB**.\n\n{procs}\n\n{times}\n"


def bench(steps: int, sft_steps: int | None, repeats: int, work: Path, baseline: Path | None = None) -> str:
    """`repeats` runs of this checkout; with `baseline` (another checkout), its runs interleaved with them
    (baseline, this, baseline, this, ...) and a section for each."""
    sides = {"this checkout": harness.ROOT, **({f"baseline {baseline}": baseline} if baseline else {})}
    runs: dict[str, list[RunFigures]] = {name: [] for name in sides}
    for i in range(repeats):
        for j, (name, checkout) in enumerate(reversed(sides.items())):
            runs[name].append(measure(work / f"run{i}-{j}", steps, sft_steps, checkout))
    codes = {name: f"commit {harness.commit()}" if path == harness.ROOT else str(path) for name, path in sides.items()}
    if baseline is None:
        return render(runs["this checkout"], steps, sft_steps, codes["this checkout"])
    return "\n".join(f"### {name}\n\n{render(r, steps, sft_steps, codes[name])}" for name, r in runs.items())


def run(ws: harness.Workspace) -> str:
    """The section for `python -m tests.bench`."""
    quick = harness.QUICK
    return bench(3 if quick else 20, 20 if quick else None, 1, ws.root)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 RL steps after a 20-step warm-up")
    ap.add_argument("--steps", type=int, default=20, help="RL steps (default 20)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--sft-steps", type=int, help="warm-up steps (default: the profile's; 20 with --quick)")
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. `git worktree add`) run interleaved")
    args = ap.parse_args(argv)
    steps, sft = (3, 20) if args.quick else (args.steps, args.sft_steps)
    with tempfile.TemporaryDirectory(prefix="rollflow-memory-") as tmp:
        text = bench(steps, sft, args.repeats, Path(tmp), args.baseline and args.baseline.resolve())
        print(f"## {TITLE}\n\n{text}", flush=True)


if __name__ == "__main__":
    main()
