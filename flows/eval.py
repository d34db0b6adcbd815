"""The `eval` flow: evaluate one model on the environments' held-out splits (`rollflow eval`).

Flow (this process)                                   subprocess task
  claim evals/<name>/ (_eval.json; a rerun continues its committed chunks)
  write evals/<name>/_inference.json
  start the inference server ------------------------> python -m engines.inference --config .../_inference.json
                                                          (the profile's backend; serves publication --step of
                                                          --run, or --model's own weights as version 0)
  wait for /health, then the evaluation over HTTP (engines/orchestrator/evaluation.py), a progress bar on stderr,
  chunks committed as they finish, the summary last; a server that stops making progress (its heartbeats, the
  stall watch of runtime/stall.py) or exits is stopped and restarted (`restart.max_restarts` times), and the
  evaluation goes on from its committed chunks
  stop the server; MLflow run `eval-<name>` (params: the spec; metrics at the evaluated version); the
  `eval-<name>` markdown artifact
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import CancelledError
from typing import Any

import httpx
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from config.eval import EvalTarget
from config.process import ComponentPaths, InferenceProcessConfig
from config.run import RunConfig
from config.stall import HEARTBEAT_ENV
from config.tracking import resolve_tracking_uri
from engines.environments.base import EnvMix
from engines.models import modeldir
from engines.orchestrator.evaluation import Evaluator, spec_for
from runtime.process import ComponentFailed
from runtime.rundir import free_port
from runtime.stall import StallWatch
from runtime.tracking import end_mlflow_run, start_mlflow_run
from storage import evals
from storage.fs import CONFIG_STORAGE_ENV, Storage, is_local, join, write_json
from storage.metrics import mlflow_name
from tasks.components import run_component


def _inference_config(cfg: RunConfig, t: EvalTarget, fs, directory: str) -> tuple[str, InferenceProcessConfig]:
    """Write the server's config next to the results; returns its URL and the config."""
    inference = cfg.inference.model_copy(update={"port": cfg.inference.port or free_port(cfg.inference.host)})
    icfg = InferenceProcessConfig(
        run=ComponentPaths(output_dir=t.run_dir or t.output_dir, run_id=f"eval-{t.name}", storage=cfg.storage),
        model=t.model,
        inference=inference,
        seed=cfg.seed,
        serve_version=t.step,
        pretrained=t.run_dir is None,
    )
    write_json(fs, join(directory, "_inference.json"), icfg.model_dump(mode="json"))
    return t.output_dir.rstrip("/") + f"/evals/{t.name}/_inference.json", icfg


async def _healthy(client: httpx.AsyncClient, server, timeout_s: float) -> None:
    """Wait for the server's /health, or fail at once when its process has ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.wrapped_future.done():
            server.result()  # raises the component's failure
            raise RuntimeError("the inference server exited before it was healthy")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"inference server at {client.base_url} not healthy after {timeout_s}s")


def _ended(server, within_s: float) -> bool:
    """Whether the server's task ends within `within_s`."""
    with contextlib.suppress(TimeoutError, CancelledError):
        server.wrapped_future.exception(timeout=within_s)
    return server.wrapped_future.done()


async def _watched(work: Coroutine[Any, Any, dict], server, settle_s: float = 30.0) -> dict:
    """`work`, cancelled as soon as the server's task ends (stuck, failed, or exited on its own). A request that
    could not reach the server is explained by the server's end when it ends within `settle_s`: the flow stops
    a stuck server before its task reports why."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=0.5))[0]:
        if server.wrapped_future.done():
            task.cancel()
            break
    unreachable = not task.cancelled() and isinstance(task.exception(), httpx.TransportError)
    if task.cancelled() or (unreachable and await asyncio.to_thread(_ended, server, settle_s)):
        server.result()  # raises the component's failure, ComponentStalled for a stuck server
        raise ComponentFailed("the inference server exited during the evaluation", 0)
    return task.result()


async def _run(cfg: RunConfig, t: EvalTarget, spec: dict, fs, directory: str, icfg, server) -> dict:
    from tqdm import tqdm

    url = f"http://{icfg.inference.host}:{icfg.inference.port}"
    tok = modeldir.load_tokenizer(modeldir.resolve(t.model))
    envs = EnvMix(cfg.envs, cfg.seed, tok.prompt_style).envs
    limit = asyncio.Semaphore(cfg.eval.requests_in_flight or cfg.orchestrator.requests_in_flight)
    total = len(spec["envs"]) * spec["num_tasks"]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        await _healthy(client, server, cfg.orchestrator.inference_timeout_s)
        with tqdm(total=total, desc=f"eval {t.name}", unit="task", file=sys.stderr) as bar:
            header = cfg.inference.vllm.router.session_header
            evaluator = Evaluator(client, limit, tok, envs, spec, fs, directory, header, bar.update)
            return await _watched(evaluator.run(), server)


def _evaluate_once(cfg: RunConfig, t: EvalTarget, spec: dict, fs, directory: str) -> dict:
    """Start the server, evaluate, stop the server (also when the evaluation fails)."""
    config_url, icfg = _inference_config(cfg, t, fs, directory)
    logs = join(directory, "_logs") if is_local(fs) else f"rollflow-logs/eval-{t.name}"
    env = {CONFIG_STORAGE_ENV: cfg.storage.model_dump_json()}
    stall = StallWatch(cfg.restart.stall) if cfg.restart.stall.enabled else None
    if stall is not None:
        env[HEARTBEAT_ENV] = str(cfg.restart.stall.heartbeat_s)
    stop = threading.Event()
    log = join(logs, "inference.log")
    server = run_component.submit("inference", "engines.inference", config_url, env, log, stop, stall=stall)
    try:
        return asyncio.run(_run(cfg, t, spec, fs, directory, icfg, server))
    finally:
        stop.set()
        server.wait()


def _evaluate(cfg: RunConfig, t: EvalTarget, spec: dict, fs, directory: str, logger) -> dict:
    """`_evaluate_once`, again from the committed chunks after a stuck or failed server."""
    for attempt in range(1, cfg.restart.max_restarts + 2):
        try:
            return _evaluate_once(cfg, t, spec, fs, directory)
        except ComponentFailed as e:  # ComponentStalled too
            if attempt > cfg.restart.max_restarts:
                raise
            logger.warning(f"restart {attempt}/{cfg.restart.max_restarts} of the evaluation's server: {e}")
    raise AssertionError("unreachable")


def _log_mlflow(cfg: RunConfig, t: EvalTarget, directory: str, summary: dict, logger) -> str | None:
    """An MLflow run `eval-<name>`: the spec as params, the summary's metrics at the evaluated version."""
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, t.output_dir) if cfg.tracking.mlflow else None
    if uri is None:
        return None
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    tags = {"rollflow.kind": "eval", "rollflow.eval_dir": directory}
    run_id = start_mlflow_run(uri, cfg.tracking.experiment, f"eval-{t.name}", {"eval": summary["spec"]}, tags)
    now = int(time.time() * 1000)
    metrics = [Metric(mlflow_name(k), float(v), now, t.version) for k, v in summary["metrics"].items()]
    MlflowClient(uri).log_batch(run_id, metrics=metrics)
    end_mlflow_run(uri, run_id, "FINISHED")
    logger.info(f"MLflow run {run_id} in {uri}")
    return run_id


def to_markdown(name: str, summary: dict) -> str:
    header, rows = evals.table_rows(summary)

    def fmt(v):
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = [f"# rollflow eval `{name}`", "", f"policy versions: {summary['policy_versions']}", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


@flow(name="eval", log_prints=True)
def evaluate(config: dict, target: dict) -> dict:
    """Evaluate `target` (an EvalTarget) with the run config's `[eval]` settings; returns the summary."""
    logger = get_run_logger()
    cfg, t = RunConfig.model_validate(config), EvalTarget.model_validate(target)
    fs, root = Storage(cfg.storage).open(t.output_dir)
    directory = evals.eval_dir(root, t.name)
    spec = spec_for(cfg, t.describe)
    status = evals.claim(fs, directory, spec)  # the CLI claimed it already (and applied --overwrite)
    if status == "resumed" and not evals.committed_chunks(fs, directory):
        status = "new"
    logger.info(f"evaluation {t.name} -> {directory} ({status})")
    if status == "done":
        summary = evals.read_summary(fs, directory) or {}
        mlflow_run = None
    else:
        summary = _evaluate(cfg, t, spec, fs, directory, logger)
        mlflow_run = _log_mlflow(cfg, t, directory, summary, logger)
    key = "eval-" + re.sub(r"[^a-z0-9-]+", "-", t.name.lower())
    create_markdown_artifact(to_markdown(t.name, summary), key=key, description=f"rollflow eval {t.name}")
    return {"name": t.name, "dir": directory, "status": status, "mlflow_run_id": mlflow_run, **summary}
