"""The `rl` flow: warm up, then run inference, orchestrator and trainer side by side until the trainer
finishes `max_steps`; stop everything cleanly if any component fails; end with a summary artifact.

Flow (this process)          subprocess tasks
  prepare run dir, configs
  warmup ------------------> python -m engines.trainer --config config/sft.json   (publishes version 0)
  inference, orchestrator, -> python -m engines.{inference,orchestrator,trainer} --config config/<name>.json
  trainer (concurrently)
  summary artifact, MLflow run closed
"""

from __future__ import annotations

import secrets
import threading
import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.prepare import free_port, new_run_id, run_exists, write_configs
from flows.summary import summarize, to_markdown
from rollflow.config import RunConfig
from storage.fs import get_fs, join
from tasks.components import run_component
from tasks.tracking import end_mlflow_run, resolve_tracking_uri, start_mlflow_run


class RunExistsError(RuntimeError):
    pass


def _supervise(futures: dict, stop: threading.Event, logger) -> None:
    """Wait until every component task ends. The trainer finishing ends the run (`stop` tells the others
    to shut down); any component failing stops the rest and re-raises its error."""
    pending = dict(futures)
    while pending:
        for name, fut in list(pending.items()):
            if not fut.wrapped_future.done():  # local check; `fut.state` would ask the API each poll
                continue
            del pending[name]
            if not fut.state.is_completed():
                logger.error(f"{name} failed; stopping the other components")
                stop.set()
                for other in pending.values():
                    other.wait()
                fut.result()  # raises the component's error
            if name == "trainer":
                stop.set()
        time.sleep(0.2)


def _prepare(cfg: RunConfig, overwrite: bool) -> tuple[str, str | None, str | None, dict[str, str]]:
    """Claim the output dir, pick the port, open tracking, write configs -> (run_id, uri, mlflow id, urls)."""
    fs, root = get_fs(cfg.output_dir)
    if run_exists(cfg.output_dir):
        if not overwrite:
            raise RunExistsError(f"{cfg.output_dir} already holds a run; pass --overwrite or another --output-dir")
        fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)
    run_id = new_run_id(cfg)
    cfg.inference.port = cfg.inference.port or free_port(cfg.inference.host)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.output_dir) if cfg.tracking.mlflow else None
    mlflow_run_id = None
    if tracking_uri:
        params = cfg.model_dump(mode="json")
        tags = {"rollflow.run_id": run_id}
        mlflow_run_id = start_mlflow_run(tracking_uri, cfg.tracking.experiment, run_id, params, tags)
    inference_url = f"http://{cfg.inference.host}:{cfg.inference.port}"
    urls = write_configs(cfg, run_id, inference_url, tracking_uri, mlflow_run_id)
    return run_id, tracking_uri, mlflow_run_id, urls


def _run_components(urls: dict[str, str], logs: str, logger) -> None:
    """Warm-up to completion, then inference, orchestrator and trainer side by side."""
    env = {"ROLLFLOW_ADMIN_TOKEN": secrets.token_hex(16)}  # per run; never written to disk or logged
    stop = threading.Event()
    try:
        run_component("warmup", urls["sft"], env, join(logs, "warmup.log"), stop)
        futures = {
            name: run_component.submit(name, urls[name], env, join(logs, f"{name}.log"), stop)
            for name in ("inference", "orchestrator", "trainer")
        }
        _supervise(futures, stop, logger)
    finally:
        stop.set()


@flow(name="rl", log_prints=True)
def rl(config: dict, overwrite: bool = False) -> dict:
    logger = get_run_logger()
    t0 = time.time()
    cfg = RunConfig.model_validate(config)
    run_id, tracking_uri, mlflow_run_id, urls = _prepare(cfg, overwrite)
    logger.info(f"run {run_id} -> {cfg.output_dir}")
    status = "FAILED"
    try:
        _run_components(urls, join(get_fs(cfg.output_dir)[1], "logs"), logger)
        status = "FINISHED"
    finally:
        if tracking_uri and mlflow_run_id:
            end_mlflow_run(tracking_uri, mlflow_run_id, status)
    summary = summarize(cfg.output_dir, time.time() - t0)
    create_markdown_artifact(to_markdown(summary), key="rl-run-summary", description=f"run {run_id}")
    logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary
