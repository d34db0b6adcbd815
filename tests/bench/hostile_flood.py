"""A hostile client floods the inference server while an RL run uses it: does the run still make progress,
at what step time, with its usual mismatch_kl? `python -m tests.bench.hostile_flood [--steps N] [--repeats R]`.

Each repeat runs the benchmark workload (tests/bench/bench.toml on profiles/tiny-cpu.toml) twice, interleaved:
quiet, then with `WORKERS` threads sending hostile requests (tests/hostile.py) to the run's own server on
loopback for as long as the run lasts. Prints a markdown section (the step-time ratio, mismatch_kl, what the
server answered) for docs/security.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

from tests.bench import harness
from tests.bench.harness import RunTimes, Stats, Workspace, machine, ratio_stats, table
from tests.hostile import flood

TITLE = "Hostile flood during an RL run (tests/bench/hostile_flood.py)"
WORKERS = 8


def _inference_url(out: Path, stop: threading.Event) -> str | None:
    """The run's server, once its orchestrator config is written (bounded by the run's own lifetime)."""
    path = out / "config" / "orchestrator.json"
    while not stop.is_set():
        if path.exists():
            url = json.loads(path.read_text())["inference_url"]
            assert "//127.0.0.1:" in url, f"the flood targets loopback only, not {url}"
            return url
        stop.wait(0.1)
    return None


def _max_kl(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return max(r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None)


def flooded_run(ws: Workspace, name: str, steps: int) -> tuple[Path, Counter]:
    """One run with the flood against its server; the flood ends when the run does."""
    out = ws.root / name
    shutil.rmtree(out, ignore_errors=True)  # a previous run's config would name a dead port
    stop, answers = threading.Event(), Counter()

    def attack() -> None:
        url = _inference_url(out, stop)
        if url is not None:
            answers.update(flood(url, stop, WORKERS))

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    try:
        ws.run(name, max_steps=steps)
    finally:
        stop.set()
        thread.join(timeout=60)
    return out, answers


def measure(ws: Workspace, steps: int, repeats: int) -> str:
    quiet: list[Path] = []
    loud: list[Path] = []
    answers: Counter = Counter()
    for r in range(repeats):
        quiet.append(ws.run(f"quiet-r{r}", max_steps=steps))
        out, got = flooded_run(ws, f"flood-r{r}", steps)
        loud.append(out)
        answers.update(got)
    tq = [RunTimes.read(o).wall_per_step for o in quiet]
    tl = [RunTimes.read(o).wall_per_step for o in loud]
    rows = [
        ["quiet", Stats(tq).fmt(unit=" s"), "1", f"{max(_max_kl(o) for o in quiet):.1e}"],
        ["flooded", Stats(tl).fmt(unit=" s"), ratio_stats(tl, tq).fmt() + "x", f"{max(_max_kl(o) for o in loud):.1e}"],
    ]
    kinds: dict[str, Counter] = {}
    for (kind, got), count in answers.items():
        kinds.setdefault(kind, Counter())[got] += count
    answered = [[k, ", ".join(f"{code} x{n}" for code, n in sorted(c.items()))] for k, c in kinds.items()]
    return "\n\n".join(
        [
            table(["run", "wall / step", "vs quiet", "max mismatch_kl"], rows),
            f"What the server answered the flood ({WORKERS} threads, {sum(answers.values())} requests):",
            table(["request", "answers"], answered),
        ]
    )


def run(ws: Workspace) -> str:
    """The runner's entry (`python -m tests.bench --every --quick`): 3 steps and one repeat in quick mode."""
    return measure(ws, 3 if harness.QUICK else 20, harness.repeats(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/rollflow-bench-flood")
    args = parser.parse_args()
    t0 = time.time()
    body = measure(Workspace(Path(args.dir)), args.steps, args.repeats)
    m = machine()
    print(
        f"## Hostile flood during an RL run\n\n`python -m tests.bench.hostile_flood --steps {args.steps} "
        f"--repeats {args.repeats}`: commit {m['commit']}, {m['CPU']}, {m['cores usable']} cores, "
        f"{time.time() - t0:.0f} s.\n\n{body}"
    )


if __name__ == "__main__":
    main()
