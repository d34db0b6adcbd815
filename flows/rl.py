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
    """Wait for the trainer to finish; on any failure, stop the rest and re-raise the first error."""
    while True:
        for name, fut in futures.items():
            state = fut.state
            if state.is_failed() or state.is_crashed():
                logger.error(f"{name} failed; stopping the other components")
                stop.set()
                for other in futures.values():
                    other.wait()
                fut.result()  # raises the component's error
            if name == "trainer" and state.is_completed():
                stop.set()
                for other in futures.values():
                    other.wait()
                return
        time.sleep(0.2)


@flow(name="rl", log_prints=True)
def rl(config: dict, overwrite: bool = False) -> dict:
    logger = get_run_logger()
    t0 = time.time()
    cfg = RunConfig.model_validate(config)
    fs, root = get_fs(cfg.output_dir)
    if run_exists(cfg.output_dir):
        if not overwrite:
            raise RunExistsError(f"{cfg.output_dir} already holds a run; pass --overwrite or another --output-dir")
        fs.rm(root, recursive=True)
    run_id = new_run_id(cfg)
    port = cfg.inference.port or free_port(cfg.inference.host)
    cfg.inference.port = port
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.output_dir) if cfg.tracking.mlflow else None
    mlflow_run_id = None
    if tracking_uri:
        fs.makedirs(root, exist_ok=True)
        params = cfg.model_dump(mode="json")
        mlflow_run_id = start_mlflow_run(
            tracking_uri, cfg.tracking.experiment, run_id, params, {"rollflow.run_id": run_id}
        )
    urls = write_configs(cfg, run_id, f"http://{cfg.inference.host}:{port}", tracking_uri, mlflow_run_id)
    logger.info(f"run {run_id} -> {cfg.output_dir}")
    env = {"ROLLFLOW_ADMIN_TOKEN": secrets.token_hex(16)}
    stop = threading.Event()
    logs = join(root, "logs")
    status = "FAILED"
    try:
        run_component("warmup", urls["sft"], env, join(logs, "warmup.log"), stop)
        futures = {
            name: run_component.submit(name, urls[name], env, join(logs, f"{name}.log"), stop)
            for name in ("inference", "orchestrator", "trainer")
        }
        _supervise(futures, stop, logger)
        status = "FINISHED"
    finally:
        stop.set()
        if tracking_uri and mlflow_run_id:
            end_mlflow_run(tracking_uri, mlflow_run_id, status)
    summary = summarize(cfg.output_dir, time.time() - t0)
    create_markdown_artifact(to_markdown(summary), key="rl-run-summary", description=f"run {run_id}")
    logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary
