"""Shared benchmark machinery: repeats with min/median/max, markdown tables, the machine, and real runs.

Every figure in docs/benchmarks.md is a ratio against a baseline measured in the same process and the
same minutes, because the 2-core machines here are shared and noisy; repeats interleave the two sides
(A, B, A, B, ...) so a noisy neighbour hurts both alike.

Runs (benchmarks 1 and 5) use the real components: `python -m engines.{inference,orchestrator,trainer}`
started and stopped by the same supervisor the Prefect flow uses (`runtime.process.supervise`), on a copy of
one warm-up's output, so a run's cost is its RL steps only.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from config.cpus import CpuPlan
from config.loader import load_run_config
from config.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "profiles/tiny-cpu.toml", ROOT / "tests/bench/bench.toml"]
QUICK = os.environ.get("ROLLFLOW_BENCH_QUICK") == "1"  # smoke mode: fewer repeats and steps


def repeats(full: int) -> int:
    return 1 if QUICK else full


# --- statistics and tables -------------------------------------------------------------------------------


@dataclass
class Stats:
    """Values of one figure over repeats."""

    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, digits: int = 3, unit: str = "") -> str:
        """`median (min-max)`; a single value is shown alone."""
        if not self.values:
            return "n/a"
        med = num(self.median, digits) + unit
        if len(self.values) == 1:
            return med
        return f"{med} ({num(min(self.values), digits)}-{num(max(self.values), digits)})"


def num(v: float, digits: int = 3) -> str:
    """`digits` significant digits, without exponent notation for the magnitudes shown here."""
    if abs(v) >= 10**digits:
        return f"{v:,.0f}"
    return f"{v:#.{digits}g}".rstrip(".") if v else "0"


def ratio_stats(numerators: Sequence[float], denominators: Sequence[float]) -> Stats:
    """Per-repeat ratios (repeat i against repeat i), so a slow minute cancels out."""
    return Stats([n / d for n, d in zip(numerators, denominators, strict=True) if d > 0])


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(sides: dict[str, Callable[[], float]], n: int) -> dict[str, Stats]:
    """Run each side once per repeat, in turn: A, B, A, B, ... Each callable returns its figure."""
    out = {name: Stats() for name in sides}
    for _ in range(n):
        for name, fn in sides.items():
            out[name].add(fn())
    return out


# --- the machine -----------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def commit() -> str:
    """The checkout's commit, `+changes` when the work tree differs from it."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head.stdout.strip() or "unknown") + (" +changes" if dirty.stdout.strip() else "")


def machine() -> dict[str, str]:
    import torch

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    mem = _mem_gib()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "CPU": _cpu_model(),
        "cores usable": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
        "memory": f"{mem:.0f} GiB" if mem else "unknown",
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in load) if load else "unknown",
        "GPU": "none (GPU figures were not measured)",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": f"{torch.__version__} (threads per process: 1 unless stated)",
        "transformers": hf,
        "commit": commit(),
    }


# --- stand-alone benchmark commands ----------------------------------------------------------------------


def module_output(module: str, *args: str, timeout_s: float = 3600) -> str:
    """`python -m module args` from the checkout's root, bounded: its stdout, or an error with its output's tail.
    The child inherits ROLLFLOW_BENCH_QUICK, so a module that reads harness.QUICK runs its quick mode too."""
    argv = [sys.executable, "-m", module, *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"`python -m {module} {' '.join(args)}` exited {proc.returncode}:\n{tail}")
    return proc.stdout


def demoted(markdown: str) -> str:
    """A command's own `## ` sections as subsections of the page's section for it."""
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.strip().splitlines())


# --- real runs -------------------------------------------------------------------------------------------


def bench_config(output_dir: Path, profiles: Sequence[Path] = PROFILES, **overrides: object) -> RunConfig:
    """The benchmark workload (profiles/tiny-cpu.toml + tests/bench/bench.toml, or `profiles`) with dotted
    overrides."""
    pairs = [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in overrides.items()]
    cfg = load_run_config(list(profiles), [("output_dir", str(output_dir)), *pairs])
    if QUICK:
        cfg.max_steps = min(cfg.max_steps, 3)
        cfg.sft.steps = min(cfg.sft.steps, 20)
    return cfg


def _component_argv(module: str, config_url: str) -> list[str]:
    return [sys.executable, "-m", module, "--config", config_url]


def _supervise_all(
    names: Sequence[str], urls: dict[str, str], env: dict[str, str], logs: Path, cpus: CpuPlan | None = None
) -> None:
    """Start components like the flow does (own process groups, output to logs/, on the cores `cpus` gives
    each); return when the trainer exits, then stop the rest. Raises if any component fails."""
    from config.registry import COMPONENT_MODULES as modules
    from runtime.process import supervise

    stop = threading.Event()
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            argv = _component_argv(modules[name], urls[name])
            own = {**env, **(cpus.env(name) if cpus is not None else {})}
            supervise(name, argv, own, lambda _line: None, stop, str(logs / f"{name}.log"))
        except BaseException as exc:  # noqa: BLE001 - reported after the others stop
            errors.append(exc)
        finally:
            if name == "trainer" or errors:
                stop.set()

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"benchmark run in {logs.parent} failed: {errors[0]}") from errors[0]


def warm_up(cfg: RunConfig) -> Path:
    """Run the warm-up once into cfg.output_dir; later runs copy its version-0 weights and tokenizer."""
    from runtime.rundir import free_port, new_run_id, write_configs

    out = Path(cfg.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    cfg.inference.port = free_port(cfg.inference.host)
    urls = write_configs(cfg, new_run_id(cfg), f"http://{cfg.inference.host}:{cfg.inference.port}")
    _supervise_all(["warmup"], {"warmup": urls["sft"]}, {}, out / "logs")
    return out


def direct_run(cfg: RunConfig, template: Path) -> Path:
    """One RL run of cfg's steps from the template's version 0, components supervised without Prefect."""
    from runtime.rundir import free_port, new_run_id, write_configs

    out = Path(cfg.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for entry in ("tokenizer", "weights"):
        shutil.copytree(template / entry, out / entry)
    cfg.inference.port = free_port(cfg.inference.host)
    urls = write_configs(cfg, new_run_id(cfg), f"http://{cfg.inference.host}:{cfg.inference.port}")
    from engines.protocol import ADMIN_TOKEN_ENV

    token = {ADMIN_TOKEN_ENV: os.urandom(16).hex()}
    cpus = cfg.cpu_plan(os.sched_getaffinity(0))
    _supervise_all(["inference", "orchestrator", "trainer"], urls, token, out / "logs", cpus)
    return out


@dataclass
class RunTimes:
    """Per-step timings of a finished run, from metrics.jsonl and the rollout manifests.

    Steady state skips step 1: before it nothing overlaps and the engine's first batch warms up.
    """

    wall_per_step: float  # (time of last step - time of first step) / (steps - 1)
    gen: float  # orchestrator: first request to last response, per step (median)
    train: float  # trainer: rollouts read to weights published, per step (median)
    wait: float  # trainer: waiting for the step's committed rollouts, per step (median)
    trainer_idle: float  # trainer's wait for rollouts / its wall time, steady state
    inference_idle: float  # 1 - sum(gen) / wall, steady state (the engine is busy only while a step generates)
    completion_lengths: list[int]

    @classmethod
    def read(cls, out: Path) -> RunTimes:
        import pyarrow.dataset as ds

        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steady = rows[1:] if len(rows) > 1 else rows
        wall = rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else rows[0]["step_s"]
        gens = [_manifest(out, r["step"])["gen_s"] for r in steady]
        trains = [r["train_s"] + r["publish_s"] for r in steady]
        lengths = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table(["completion_ids"])
        return cls(
            wall_per_step=wall / len(steady),
            gen=statistics.median(gens),
            train=statistics.median(trains),
            wait=statistics.median(r["wait_s"] for r in steady),
            trainer_idle=sum(r["wait_s"] for r in steady) / max(wall, 1e-9),
            inference_idle=max(0.0, 1 - sum(gens) / max(wall, 1e-9)),
            completion_lengths=[len(c) for c in lengths.column("completion_ids").to_pylist()],
        )


def _manifest(out: Path, step: int) -> dict:
    return json.loads((out / "rollouts" / f"step={step:06d}" / "_manifest.json").read_text())


class Workspace:
    """Scratch space of one `make bench`: one warm-up shared by every run, and runs other benchmarks reuse."""

    def __init__(self, root: Path):
        self.root = root
        self._template: Path | None = None
        self.runs: dict[str, Path] = {}  # name -> finished run dir (benchmark 1 leaves them for 4 and 5)

    def template(self) -> Path:
        if self._template is None:
            self._template = warm_up(bench_config(self.root / "warmup"))
        return self._template

    def run(self, name: str, profiles: Sequence[Path] = PROFILES, **overrides: object) -> Path:
        out = direct_run(bench_config(self.root / name, profiles, **overrides), self.template())
        self.runs[name] = out
        return out

    def any_run(self) -> Path:
        """A finished run with the default async_level, made now if no benchmark left one."""
        for name, out in self.runs.items():
            if name.startswith("async1"):
                return out
        return self.run("async1-extra", async_level=1)
