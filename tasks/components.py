"""Prefect tasks around the run's components and its tracking."""

from __future__ import annotations

import sys
import threading

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from runtime.process import supervise
from runtime.stall import StallWatch


@task(cache_policy=NONE, task_run_name="{name}")
def run_component(
    name: str,
    module: str,
    config_url: str,
    env: dict[str, str],
    log_path: str,
    stop: threading.Event,
    srun: list[str] | None = None,
    nudge: threading.Event | None = None,
    launcher: list[str] | None = None,
    stall: StallWatch | None = None,
) -> int:
    """Launch `python -m <module> --config <config_url>` and supervise it until it exits or `stop` is set.
    Inside a Slurm job `srun` is the job-step prefix that places it (launch/slurm.py); locally None.
    `nudge` set: the component gets SIGUSR1 (the trainer checkpoints after its current step).
    `launcher`: arguments between the interpreter and `-m <module>`, e.g. torchrun's (`torchrun_args`).
    `stall`: the attempt's stall watch (runtime/stall.py); a stuck component raises ComponentStalled."""
    logger = get_run_logger()
    argv = [*(srun or []), sys.executable, *(launcher or []), "-m", module, "--config", config_url]
    logger.info(f"starting {name}: {' '.join(argv)}")
    emit = lambda line: logger.info(f"[{name}] {line}")  # noqa: E731
    rc = supervise(name, argv, env, emit, stop, log_path, nudge=nudge, stall=stall)
    logger.info(f"{name} exited with code {rc}")
    return rc
