"""The `sft` flow: supervised fine-tuning on a dataset as a run of its own (`rollflow sft`), with the `rl`
flow's lease, run bookkeeping, supervision and restarts; ends with a summary (loss curve, data, skipped rows).

Flow (this process)               subprocess task
  lease held for the whole run
  open or reopen the run          (runtime/lifecycle.py: config/run.json, state.json, MLflow run)
  attempt: resume point, rollback (storage/resume.py: the newest verified checkpoint), config/sft.json
           sft -----------------> [torchrun ...] python -m engines.trainer --config config/sft.json
  on a failure: back off, next attempt from the last checkpoint (runtime/restarts.py); a refused dataset
  (exit code EXIT_REFUSED) ends the run at once
  close the run: state.json, MLflow status, summary artifact `sft-run-summary`
"""

from __future__ import annotations

import threading
import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from config.process import EXIT_REFUSED, warmup_parallel
from config.run import RunConfig
from config.stall import HEARTBEAT_ENV
from flows.cancel import outcome
from launch.torchrun import torchrun_args
from runtime.lease import LeaseKeeper, hold_lease
from runtime.lifecycle import RunHandle, close_run, reopen_run, start_new_run
from runtime.process import ComponentFailed
from runtime.restarts import RestartBudget
from runtime.rundir import logs_dir, write_sft_configs
from runtime.stall import StallWatch
from runtime.summary import sft_markdown, summarize_sft
from storage.fs import CONFIG_STORAGE_ENV, Storage, join
from storage.metrics import read_metrics
from storage.resume import repair, resume_point, rollback
from storage.runstate import write_state
from tasks.components import run_component

TRAINER_MODULE = "engines.trainer"


class DatasetRefused(RuntimeError):
    """The trainer refused the dataset (a bad row with on_bad_row = 'error'): a restart would too."""


def _prepare(cfg: RunConfig, run: RunHandle, logger) -> tuple[int | None, str]:
    """Roll the directory back to the newest verified checkpoint and write this attempt's config/sft.json;
    returns (the checkpoint step or None, the config's URL)."""
    fs, root = Storage(cfg.storage).open(cfg.output_dir)
    step = resume_point(fs, root, logger.warning)
    for what in rollback(fs, root, step):
        logger.info(f"rolled back: removed {what}")
    repair(fs, root, step, logger.warning)
    urls = write_sft_configs(cfg, run.run_id, run.tracking_uri, run.state.mlflow_run_id, step)
    logger.info(f"starting from {'checkpoint step=' + str(step) if step is not None else 'the model'}")
    return step, urls["sft"]


def _env(cfg: RunConfig, tracking_uri: str | None) -> dict[str, str]:
    """The trainer's environment: storage settings to read its config, the tracking URI with credentials, and
    the heartbeat interval of the stall watch (restart.stall)."""
    return {
        CONFIG_STORAGE_ENV: cfg.storage.model_dump_json(),
        **({HEARTBEAT_ENV: str(cfg.restart.stall.heartbeat_s)} if cfg.restart.stall.enabled else {}),
        **({"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {}),
    }


def _attempts(cfg: RunConfig, run: RunHandle, logger, lease: LeaseKeeper) -> None:
    """Attempt after attempt until the trainer finishes; give up after `restart.max_restarts` failures in a
    row that each restarted from the same checkpoint, or at once when the dataset is refused."""
    fs, root = Storage(cfg.storage).open(cfg.output_dir)
    log_path = join(logs_dir(fs, root, run.run_id), "sft.log")
    launcher = torchrun_args(warmup_parallel(cfg).world_size)
    budget = RestartBudget(cfg.restart)
    while True:
        step, url = _prepare(cfg, run, logger)
        run.state.attempts += 1
        write_state(fs, root, run.state)
        budget.attempt_from(step)
        stop = threading.Event()
        lease.attach(stop)  # a lost lease stops the attempt at once
        try:
            stall = StallWatch(cfg.restart.stall) if cfg.restart.stall.enabled else None  # a stuck trainer fails it
            env = _env(cfg, run.tracking_uri)
            run_component("sft", TRAINER_MODULE, url, env, log_path, stop, None, None, launcher, stall)
            return
        except ComponentFailed as exc:
            lease.raise_if_lost()
            if exc.returncode == EXIT_REFUSED:
                raise DatasetRefused(str(exc)) from None
            delay = budget.failed(exc)
            logger.warning(budget.notice(exc, delay))
            time.sleep(delay)


@flow(name="sft", log_prints=True)
def sft(config: dict, overwrite: bool = False, resume: bool = False) -> dict:
    logger = get_run_logger()
    t0 = time.time()
    cfg = RunConfig.model_validate(config)
    fs, root = Storage(cfg.storage).open(cfg.output_dir)
    fs.makedirs(root, exist_ok=True)
    with hold_lease(fs, root, cfg.restart.lease_ttl_s, logger) as lease:
        run = reopen_run(cfg, logger) if resume else start_new_run(cfg, overwrite)
        logger.info(f"sft run {run.run_id} -> {cfg.output_dir}" + (" (resumed)" if resume else ""))
        finished = False
        try:
            _attempts(cfg, run, logger, lease)
            finished = True
        finally:
            close_run(cfg, run, outcome(finished, logger))
    summary = summarize_sft(fs, root, cfg.output_dir, time.time() - t0)
    report = sft_markdown(summary, read_metrics(fs, root))
    create_markdown_artifact(report, key="sft-run-summary", description=f"run {run.run_id}")
    logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "loss_curve"))
    return summary
