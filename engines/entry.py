"""What every process entry module does first: `python -m engines.X --config FILE`.

Parses `--config`, binds the process to the cores the flow gave it (`ROLLFLOW_CPUS`, config/cpus.py; before
any thread pool starts, so every later thread inherits them), sets up logging, and returns the resolved config's
JSON (written by the run's `config/` step, runtime/rundir.py); the entry module validates it with its own typed
config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from config.cpus import CPUS_ENV, parse_cpu_list
from storage.fs import read_json

log = logging.getLogger(__name__)


def bind_cpus() -> list[int] | None:
    """Run this process (and what it starts) on the cores `ROLLFLOW_CPUS` names; unset: anywhere.
    A list that is not a CPU list, or names no core this process may use, is an error naming it."""
    text = os.environ.get(CPUS_ENV)
    if not text:
        return None
    try:
        cpus = parse_cpu_list(text)
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{CPUS_ENV}={text!r}: cannot bind this process to it ({exc})") from None
    return cpus


def read_process_config(prog: str, description: str | None, argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--config", required=True, help="the component's resolved config (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if (cpus := bind_cpus()) is not None:
        log.info(f"bound to CPU(s) {os.environ[CPUS_ENV]} ({len(cpus)} core(s))")
    return read_json(args.config)


def exit_done(code: int | str | None = 0) -> NoReturn:
    """End a process whose work is done and written: flush its output, then leave without the interpreter's
    teardown, which takes 0.6-0.9 s with torch loaded (measured here: `import torch` then exit, 0.59 s after
    the last line against 0.03 s with this; the inference server, SIGTERM to exit, 1.18 s against 0.16 s) and
    sits on the path to the first RL step when it ends the warm-up, and on every run's end. Every file the
    process wrote is already closed and synced; nothing it leaves needs an exit handler. `code` as SystemExit
    takes it: None is 0, a message is printed and exits 1."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
