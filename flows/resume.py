"""The `resume-unfinished` flow: what a scheduled deployment runs to resume dead runs without a person.

It lists the run directories under `runs_root` that are unfinished and whose lease is not live, and
resumes each with the config it was started with, as an `rl` subflow (so the Prefect UI shows the
resumed run under the scheduled one). The `rl` flow takes the run's lease first: when two schedulers
race for one run, one wins and the other skips it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from config.loader import load_stored_config
from flows.rl import rl
from runtime.rundir import stored_config
from storage.runstate import LeaseHeld, find_resumable


@flow(name="resume-unfinished", log_prints=True)
def resume_unfinished(runs_root: str, max_runs: int = 1) -> list[str]:
    """Resume up to `max_runs` unfinished, idle runs under `runs_root`; returns those that finished."""
    logger = get_run_logger()
    candidates = find_resumable(runs_root)
    logger.info(f"{len(candidates)} unfinished idle run(s) under {runs_root}: {candidates}")
    finished = []
    for run_dir in candidates[:max_runs]:
        cfg = load_stored_config(stored_config(run_dir), f"{run_dir}/config/run.json", [("output_dir", run_dir)])
        try:
            rl(config=cfg.model_dump(mode="json"), resume=True)
            finished.append(run_dir)
        except LeaseHeld as exc:
            logger.info(f"skipping {run_dir}: {exc}")
    return finished
