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

import concurrent.futures
import secrets
import threading
import time
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.prepare import claim_output_dir, free_port, new_run_id, public_config, write_configs
from flows.summary import summarize, to_markdown
from rollflow.config import RunConfig
from storage.fs import configure as configure_storage
from storage.fs import get_fs, join
from tasks.components import run_component
from tasks.tracking import end_mlflow_run, resolve_tracking_uri, start_mlflow_run


def _supervise(futures: dict, stop: threading.Event, logger) -> None:
    """Wait until every component task ends. The trainer finishing ends the run (`stop` tells the others
    to shut down); any component failing stops the rest and re-raises its error."""
    pending = {fut.wrapped_future: name for name, fut in futures.items()}  # local futures: no API polling
    while pending:
        done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
        for inner in done:
            name = pending.pop(inner)
            fut = futures[name]
            fut.wait()  # records the final state locally; `fut.state` before this asks the API, which may lag
            if not fut.state.is_completed():
                logger.error(f"{name} failed; stopping the other components")
                stop.set()
                concurrent.futures.wait(list(pending))
                fut.result()  # raises the component's error
            if name == "trainer":
                stop.set()
                if fut.result() != 0:
                    raise RuntimeError(f"the trainer was stopped before finishing (exit code {fut.result()})")


def _prepare(cfg: RunConfig, overwrite: bool) -> tuple[str, str | None, str | None, dict[str, str]]:
    """Claim the output dir, pick the port, open tracking, write configs -> (run_id, uri, mlflow id, urls)."""
    claim_output_dir(cfg.output_dir, overwrite)
    fs, root = get_fs(cfg.output_dir)
    fs.makedirs(root, exist_ok=True)
    run_id = new_run_id(cfg)
    cfg.inference.port = cfg.inference.port or free_port(cfg.inference.host)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.output_dir) if cfg.tracking.mlflow else None
    mlflow_run_id = None
    if tracking_uri:
        params = public_config(cfg)
        tags = {"rollflow.run_id": run_id}
        mlflow_run_id = start_mlflow_run(tracking_uri, cfg.tracking.experiment, run_id, params, tags)
    inference_url = f"http://{cfg.inference.host}:{cfg.inference.port}"
    urls = write_configs(cfg, run_id, inference_url, tracking_uri, mlflow_run_id)
    return run_id, tracking_uri, mlflow_run_id, urls


def _logs_dir(output_dir: str, run_id: str) -> str:
    """Component logs are appended line by line, which object stores cannot do: keep them on local disk."""
    fs, root = get_fs(output_dir)
    if isinstance(fs, LocalFileSystem):
        return join(root, "logs")
    return str(Path("rollflow-logs", run_id).resolve())


def _secrets_env(tracking_uri: str | None) -> dict[str, dict[str, str]]:
    """Per-component environment for secrets: never in configs on disk, argv, or logs."""
    token = {"ROLLFLOW_ADMIN_TOKEN": secrets.token_hex(16)}  # admin routes of this run's engine
    return {
        "warmup": {},
        "inference": token,
        "orchestrator": token,
        "trainer": {"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {},
    }


def _run_components(urls: dict[str, str], logs: str, tracking_uri: str | None, logger) -> None:
    """Warm-up to completion, then inference, orchestrator and trainer side by side."""
    env = _secrets_env(tracking_uri)
    stop = threading.Event()
    try:
        run_component("warmup", urls["sft"], env["warmup"], join(logs, "warmup.log"), stop)
        futures = {
            name: run_component.submit(name, urls[name], env[name], join(logs, f"{name}.log"), stop)
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
    configure_storage(cfg.storage.model_dump(mode="json"))  # exported to the components' environment
    run_id, tracking_uri, mlflow_run_id, urls = _prepare(cfg, overwrite)
    logger.info(f"run {run_id} -> {cfg.output_dir}")
    status = "FAILED"
    try:
        _run_components(urls, _logs_dir(cfg.output_dir, run_id), tracking_uri, logger)
        status = "FINISHED"
    finally:
        if tracking_uri and mlflow_run_id:
            end_mlflow_run(tracking_uri, mlflow_run_id, status)
    summary = summarize(cfg.output_dir, time.time() - t0)
    create_markdown_artifact(to_markdown(summary), key="rl-run-summary", description=f"run {run_id}")
    logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary
