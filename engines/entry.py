"""What every process entry module does first: `python -m engines.X --config FILE`.

Parses `--config`, sets up logging, and returns the resolved config's JSON (written by the run's
`config/` step, runtime/rundir.py); the entry module validates it with its own typed config.
"""

from __future__ import annotations

import argparse
import logging

from storage.fs import read_json


def read_process_config(prog: str, description: str | None, argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("--config", required=True, help="the component's resolved config (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return read_json(args.config)
