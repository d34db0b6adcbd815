"""What one core's work costs the other's: a matmul at the tiny trainer's shape on core 0, timed alone and while
core 1 runs (a) the same matmul, (b) a loop that streams a 16 MB buffer (cache and memory traffic, as the
engine's decode and the orchestrator's Python make).

`python -m tests.bench.interference [--quick]` prints its markdown section (`make bench-quick` runs it). Each
case is two processes, one pinned to each core with one torch thread, timed over the same window; a ratio
below 1 is core 0's matmul rate lost to its neighbour. Linux only (sched_setaffinity), 2 usable cores or more.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.bench.harness import QUICK, ROOT, Workspace, table

TITLE = "Interference between the two cores (tests/bench/interference.py)"
SHAPE = (1024, 192, 512)  # the trainer's MLP up-projection: 32 rows x 32 tokens, hidden 192 -> 512
CASES = {"alone": None, "next to the same matmul": "mm", "next to a 16 MB streaming loop": "stream"}


def worker(kind: str, cpu: int, seconds: float) -> float:
    """Pinned to `cpu`, one thread: iterations/s of `kind` over `seconds`."""
    import torch

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    m, k, n = SHAPE
    a, b, buf = torch.randn(m, k), torch.randn(k, n), torch.randn(4_000_000)
    work = (lambda: a @ b) if kind == "mm" else (lambda: buf.mul_(1.0000001))
    for _ in range(20):
        work()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        work()
        count += 1
    return count / (time.perf_counter() - t0)


def _worker_argv(kind: str, cpu: int, seconds: float) -> list[str]:
    code = f"from tests.bench.interference import worker; print(worker({kind!r}, {cpu}, {seconds}))"
    return [sys.executable, "-c", code]


def measure(seconds: float, repeats: int) -> dict[str, list[float]]:
    """The first usable core's matmul GFLOP/s per case, `repeats` times, cases interleaved; every worker is a
    process of its own (pinning and thread counts stay out of the caller)."""
    m, k, n = SHAPE
    first, second = sorted(os.sched_getaffinity(0))[:2]
    out: dict[str, list[float]] = {c: [] for c in CASES}
    for _ in range(repeats):
        for case, neighbour in CASES.items():
            other = None
            if neighbour:  # started first and running longer: it covers the whole timed window
                other = subprocess.Popen(
                    _worker_argv(neighbour, second, seconds + 8), cwd=ROOT, stdout=subprocess.DEVNULL
                )
            try:
                done = subprocess.run(
                    _worker_argv("mm", first, seconds),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=120,
                )
                out[case].append(float(done.stdout.split()[-1]) * 2 * m * k * n / 1e9)
            finally:
                if other is not None:
                    other.kill()
                    other.wait(timeout=60)
    return out


def report(res: dict[str, list[float]]) -> str:
    import statistics

    base = statistics.median(res["alone"])
    rows = [[case, f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})", f"{statistics.median(v) / base:.2f}"]
            for case, v in res.items()]  # fmt: skip
    return table(["core 1 runs", "core 0 matmul GFLOP/s (median (min-max))", "vs alone"], rows)


def run(ws: Workspace) -> str:
    del ws
    if len(os.sched_getaffinity(0)) < 2:
        return "Not measured: fewer than 2 usable cores."
    return __doc__.split("\n\n", 1)[1] + "\n" + report(measure(0.5 if QUICK else 4.0, 1 if QUICK else 3))


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(report(measure(0.5 if quick else 4.0, 1 if quick else 3)))
