"""The `resume-unfinished` flow: what a scheduled deployment runs to resume dead runs without a person.

It lists the run directories under `runs_root` that are unfinished and whose lease is not live, and
resumes each with the config it was started with, as an `rl` subflow (so the Prefect UI shows the
resumed run under the scheduled one). The `rl` flow takes the run's lease first: when two schedulers
race for one run, one wins and the other skips it.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from config.loader import ConfigError, load_stored_config
from config.run import RunConfig
from flows.rl import rl
from runtime.rundir import stored_config
from storage.runstate import LeaseHeld, find_resumable


def stored_run(run_dir: str, trust_run_config: bool = False) -> RunConfig:
    """The config `run_dir` was started with (its config/run.json); ConfigError if it is invalid, or names code
    other than by a registered name and `trust_run_config` is off."""
    source, overrides = f"{run_dir}/config/run.json", [("output_dir", run_dir)]
    return load_stored_config(stored_config(run_dir), source, overrides, trust=trust_run_config)


@flow(name="resume-unfinished", log_prints=True)
def resume_unfinished(runs_root: str, max_runs: int = 1, trust_run_config: bool = False) -> list[str]:
    """Resume up to `max_runs` unfinished, idle runs under `runs_root`; returns those that finished. A run whose
    stored config names code other than by a registered name is refused (config/trust.py) unless the deployment
    sets `trust_run_config` (whoever can write under `runs_root` is then trusted to run code here)."""
    logger = get_run_logger()
    candidates = find_resumable(runs_root)
    logger.info(f"{len(candidates)} unfinished idle run(s) under {runs_root}: {candidates}")
    finished = []
    for run_dir in candidates[:max_runs]:
        try:
            cfg = stored_run(run_dir, trust_run_config)
        except ConfigError as exc:  # one run directory's config must not stop the others' resumption
            logger.error(f"not resuming {run_dir}: {exc}")
            continue
        try:
            rl(config=cfg.model_dump(mode="json"), resume=True)
            finished.append(run_dir)
        except LeaseHeld as exc:
            logger.info(f"skipping {run_dir}: {exc}")
    return finished
