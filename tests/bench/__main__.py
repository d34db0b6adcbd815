"""`python -m tests.bench [NAME ...] [--long | --every] [--quick] [--out PATH]`: run benchmarks, write their region.

Three sets of benchmark modules, each module with `TITLE` and `run(workspace) -> markdown`:
- MAIN, `make bench` (no flag): the benchmarks that fit 20 minutes on 2 cores; region `make bench` of the page.
- LONG, `make bench-long` (`--long`): router replay and the backends at several sizes; region `make bench-long`.
- TOOLS: the stand-alone benchmark commands (`python -m tests.bench.X`, each writing its own doc); here only their
  quick mode, so CI's smoke run (`--every --quick`, `make bench-quick`: MAIN + LONG + TOOLS) keeps them working.

One scratch workspace is shared by the modules of a run (one warm-up, finished runs reused). The page is rewritten
through tests/bench/page.py: only this command's region changes. A benchmark that fails makes the command fail
(exit 1) and leaves the page as it was: the page it would have written, failures included, goes next to it as
`<page>.failed.md`. docs/benchmarks.md takes only whole, full runs: a quick or partial run needs `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from storage.fs import write_text_atomic
from tests.bench import harness, page

MAIN = {
    "async": "tests.bench.async_speedup",
    "inference": "tests.bench.inference",
    "weights": "tests.bench.weight_update",
    "trainer": "tests.bench.trainer",
    "orchestration": "tests.bench.orchestration",
    "scaling": "tests.bench.scaling",
    "storage": "tests.bench.storage",
    "peer": "tests.bench.peer_trl",
    "mfu": "tests.bench.cpu_mfu",
}
LONG = {
    "router_replay": "tests.bench.router_replay",
    "backends": "tests.bench.backends",
    "multitenant": "tests.bench.multitenant",
}
TOOLS = {
    "mismatch_cost": "tests.bench.mismatch_cost",
    "hostile_flood": "tests.bench.hostile_flood",
    "keep_sampling_mask": "tests.bench.keep_sampling_mask",
    "algorithms": "tests.bench.algorithms",
    "cp_memory": "tests.bench.cp_memory",
    "trainer_mfu": "tests.bench.trainer_mfu",
    "memory": "tests.bench.memory",
    "interference": "tests.bench.interference",
    "component_cpu": "tests.bench.component_cpu",
}
MODULES = {**MAIN, **LONG, **TOOLS}
PAGE = harness.ROOT / "docs/benchmarks.md"
FAILED = page.FAILED


def run_module(name: str, ws: harness.Workspace) -> tuple[str, str, float]:
    """(title, markdown, seconds); a failing benchmark reports its error instead of sinking the rest.
    A NAME with a dot and no entry in MODULES is a module path (how the runner's own test adds a module)."""
    t0 = time.perf_counter()
    title = name
    try:
        module = importlib.import_module(MODULES.get(name, name))
        title = module.TITLE
        body = module.run(ws)
    except Exception:
        body = FAILED + ":**\n\n```text\n" + traceback.format_exc()[-3000:] + "```"
    return title, body, time.perf_counter() - t0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run, of {', '.join(MODULES)} (default: the set)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--long", action="store_true", help=f"the long set ({', '.join(LONG)}): `make bench-long`")
    which.add_argument("--every", action="store_true", help="every module, main, long and tools (needs --quick)")
    parser.add_argument("--out", type=Path, default=PAGE, help="page to write this command's region into")
    parser.add_argument("--quick", action="store_true", help="1 repeat, tiny sizes: a smoke run, not figures")
    args = parser.parse_args(argv)
    args.names = args.names or list({**MAIN, **LONG, **TOOLS} if args.every else LONG if args.long else MAIN)
    if unknown := [n for n in args.names if n not in MODULES and "." not in n]:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(MODULES)}")
    if not args.quick and (args.every or any(n in TOOLS for n in args.names)):
        parser.error(f"{list(TOOLS)} run here only in --quick; run `python -m tests.bench.NAME` for their figures")
    partial = args.quick or set(args.names) != set(LONG if args.long else MAIN)
    if partial and args.out.resolve() == PAGE.resolve():
        parser.error(f"{PAGE.name} takes only a whole, full `make bench` / `make bench-long`: give --out FILE")
    return args


def _label(args: argparse.Namespace) -> str:
    if args.every:
        return "make bench-quick"
    return "make bench-long" if args.long else "make bench"


def _run_all(names: list[str]) -> list[tuple[str, str, float]]:
    sections = []
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-") as tmp:
        ws = harness.Workspace(Path(tmp))
        for name in names:
            print(f"[bench] {name} ...", flush=True)
            sections.append(run_module(name, ws))
            verdict = "FAILED" if sections[-1][1].startswith(FAILED) else "done"
            print(f"[bench] {name} {verdict} in {sections[-1][2]:.0f} s", flush=True)
    return sections


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.quick:
        os.environ["ROLLFLOW_BENCH_QUICK"] = "1"
        harness.QUICK = True
    command = os.environ.get("ROLLFLOW_BENCH_COMMAND") or "python -m tests.bench " + shlex.join(argv or sys.argv[1:])
    # SIGTERM unwinds like Ctrl-C: the scratch directory is removed and the components are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0, load_start, machine = time.perf_counter(), os.getloadavg(), harness.machine()
    sections = _run_all(args.names)
    run = page.Run(command, time.perf_counter() - t0, load_start, os.getloadavg(), machine)
    out: Path = args.out
    old = out.read_text() if out.exists() else None
    text = page.update(old, _label(args), page.render_region(_label(args), sections, run))
    if failed := page.failed(sections):
        write_text_atomic(out.with_suffix(".failed.md"), text)
        for title, body, _ in sections:  # CI's log shows why, not only that
            if title in failed:
                print(f"[bench] {title}:\n{body}", file=sys.stderr, flush=True)
        print(f"[bench] FAILED: {failed}; {out} left as it was, see {out.with_suffix('.failed.md')}", flush=True)
        return 1
    write_text_atomic(out, text)
    print(f"[bench] wrote {_label(args)}'s region of {out} in {run.total_s / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
