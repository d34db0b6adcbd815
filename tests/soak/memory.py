"""Memory of a running `rollflow rl`: RSS and PSS of the flow (CLI) process and each component, sampled every
~10 s by a daemon thread while the soak runs, summarised as first vs last sample and a per-step slope.

Samples come from /proc/PID/status (VmRSS) and /proc/PID/smaps_rollup (Pss) of the CLI process and its
descendants, named by their config file (tests/integration/conftest.py component_pid's rule). Components
restart after faults, so the slope is fitted per process (pid) and the longest-lived one is reported: growth
per trained step within one process is what a leak looks like.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.conftest import descendants

NAMES = {
    "config/trainer.json": "trainer",
    "config/orchestrator.json": "orchestrator",
    "config/inference.json": "inference",
}


def _kb(path: str, key: str) -> float | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def _name(pid: int, cli_pid: int) -> str | None:
    if pid == cli_pid:
        return "flow"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return next((name for key, name in NAMES.items() if key in cmdline), None)


@dataclass
class Sample:
    t: float
    step: int
    name: str
    pid: int
    rss_mb: float
    pss_mb: float | None


@dataclass
class MemorySampler:
    """`cli_pid()` names the current CLI process (it changes on a resume); `step()` the trained steps so far."""

    cli_pid: Callable[[], int]
    step: Callable[[], int]
    every_s: float = 10.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample_once(self) -> None:
        cli = self.cli_pid()
        step = self.step()
        for pid in [cli, *descendants(cli)]:
            name = _name(pid, cli)
            rss = _kb(f"/proc/{pid}/status", "VmRSS:") if name else None
            if name and rss is not None:
                pss = _kb(f"/proc/{pid}/smaps_rollup", "Pss:")
                self.samples.append(Sample(time.time(), step, name, pid, rss / 1024, pss and pss / 1024))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_once()

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def first_last(self) -> dict[str, tuple[float, float]]:
        out = {}
        for name in sorted({s.name for s in self.samples}):
            mine = [s for s in self.samples if s.name == name and s.step >= 1] or [
                s for s in self.samples if s.name == name
            ]  # from the first trained step on: start-up and warm-up are not the steady state
            out[name] = (round(mine[0].rss_mb, 1), round(mine[-1].rss_mb, 1))
        return out

    def slopes_kb_per_step(self) -> dict[str, float]:
        """Per name: the least-squares RSS slope (KiB per trained step) of its longest-lived process."""
        out = {}
        for name in sorted({s.name for s in self.samples}):
            by_pid: dict[int, list[Sample]] = {}
            for s in self.samples:
                if s.name == name:
                    by_pid.setdefault(s.pid, []).append(s)
            series = max(by_pid.values(), key=lambda xs: xs[-1].step - xs[0].step)
            if len(series) >= 3 and series[-1].step - series[0].step >= 5:
                out[name] = round(_slope([s.step for s in series], [s.rss_mb for s in series]) * 1024, 1)
        return out


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
