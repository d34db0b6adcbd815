"""The `shared-deployment` flow: one backbone, one inference server and one trainer that many tenant runs
share (docs/multitenant.md), up until `rollflow shared down` (or the flow run's cancellation).

Flow (this process, lease on DEPLOY_DIR held throughout)          subprocess tasks
  backbone: unless DEPLOY_DIR/weights/step=000000 is committed --> python -m engines.trainer --config config/sft.json
  configs: config/inference.json, config/shared_trainer.json, deployment.json (runtime/shared.py)
  processes, each supervised on its own --------------------------> python -m engines.inference --config ...
                                                                   python -m engines.trainer.shared --config ...
    one that exits, fails or stalls (its heartbeats, runtime/stall.py) is restarted alone after a backoff; the
    other keeps serving. Before a new trainer starts, every attached tenant's attempt is failed and its record
    removed (runtime/shared.py fail_tenants): each tenant flow restarts from its checkpoint, as it would had its
    own trainer died. restart.max_restarts failures in a row of one process (none of which ran STABLE_S)
    end the deployment as failed.
  stop: DEPLOY_DIR/shared.stop (`rollflow shared down`), the lease lost, or the flow cancelled (SIGTERM): both
    processes get SIGTERM, then SIGKILL after their grace; shared_state.json says down (or failed).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
import time

from prefect import flow, get_run_logger

from config.run import RunConfig
from config.stall import HEARTBEAT_ENV
from engines.protocol import ADMIN_TOKEN_ENV
from runtime.lease import hold_lease
from runtime.process import ComponentFailed
from runtime.restarts import RestartBudget
from runtime.rundir import free_port, logs_dir, new_run_id
from runtime.shared import (
    SHARED_COMPONENTS,
    backbone_committed,
    clear_stop,
    fail_tenants,
    shared_problems,
    stop_requested,
    write_process_configs,
    write_state,
    write_warmup_config,
)
from runtime.stall import StallWatch
from storage.fs import CONFIG_STORAGE_ENV, get_fs, join
from tasks.components import run_component

STABLE_S = 60.0  # a process that ran this long before it failed made progress: its failures count anew
POLL_S = 0.5
STOP_WAIT_S = 30.0  # each process's bounded wait on the way down (run_component's grace is 10 s)


def _env(cfg: RunConfig) -> dict[str, str]:
    beat = {HEARTBEAT_ENV: str(cfg.restart.stall.heartbeat_s)} if cfg.restart.stall.enabled else {}
    return {CONFIG_STORAGE_ENV: cfg.storage.model_dump_json(), **beat}


def _watch_stop_file(deploy_dir: str, stop: threading.Event) -> threading.Thread:
    """Set `stop` once `rollflow shared down` wrote the stop file; ends with `stop`."""

    def poll() -> None:
        while not stop.wait(POLL_S):
            if stop_requested(deploy_dir):
                stop.set()

    thread = threading.Thread(target=poll, name="shared-stop", daemon=True)
    thread.start()
    return thread


def _backbone(cfg: RunConfig, run_id: str, logs: str, stop: threading.Event, logger) -> None:
    """The base profile's warm-up publishes the backbone as version 0, once per deployment directory."""
    if backbone_committed(cfg):
        logger.info("backbone: weights/step=000000 is committed; no warm-up")
        return
    url = write_warmup_config(cfg, run_id)
    run_component("warmup", "engines.trainer", url, _env(cfg), join(logs, "warmup.log"), stop)
    if stop.is_set() or not backbone_committed(cfg):
        raise ComponentFailed("the deployment stopped before its backbone was published")


class _Processes:
    """The two processes, each launched, watched and restarted on its own."""

    def __init__(self, cfg: RunConfig, urls: dict[str, str], logs: str, stop: threading.Event, logger):
        self.cfg, self.urls, self.logs, self.stop, self.logger = cfg, urls, logs, stop, logger
        cpus = cfg.cpu_plan(os.sched_getaffinity(0))  # the backbone's profile's deployment.cpus (config/cpus.py)
        logger.info(cpus.describe())
        admin = {ADMIN_TOKEN_ENV: secrets.token_hex(16)}
        self.env = {name: {**_env(cfg), **cpus.env(name), **(admin if name == "inference" else {})} for name in urls}
        self.budgets = {n: RestartBudget(cfg.restart) for n in urls}
        self.stable = dict.fromkeys(urls, 0)
        self.restarts = dict.fromkeys(urls, 0)
        self.futures: dict = {}
        self.started: dict[str, float] = {}

    def launch(self, name: str) -> None:
        stall = StallWatch(self.cfg.restart.stall) if self.cfg.restart.stall.enabled else None
        log = join(self.logs, f"shared-{name}.log")
        self.futures[name] = run_component.submit(
            name, SHARED_COMPONENTS[name], self.urls[name], self.env[name], log, self.stop, stall=stall
        )
        self.started[name] = time.monotonic()

    def ended(self) -> list[str]:
        waiting = {f.wrapped_future: n for n, f in self.futures.items()}
        done, _ = concurrent.futures.wait(list(waiting), timeout=POLL_S, return_when="FIRST_COMPLETED")
        return [waiting[f] for f in done]

    def restart(self, name: str) -> None:
        """Relaunch `name` after its backoff; RestartsExhausted when it keeps failing without running long."""
        fut = self.futures[name]
        fut.wait()
        error = fut.result(raise_on_failure=False) if not fut.state.is_completed() else None
        why = error if isinstance(error, BaseException) else ComponentFailed(f"{name} exited on its own")
        if time.monotonic() - self.started[name] >= STABLE_S:
            self.stable[name] += 1
        budget = self.budgets[name]
        budget.attempt_from(self.stable[name])
        delay = budget.failed(why)
        self.logger.warning(f"shared {name}: {why}\nrestarting it in {delay:.1f}s")
        if not self.stop.wait(delay):
            if name == "trainer":  # its tenants restart from their checkpoints (runtime/shared.py fail_tenants)
                ended = fail_tenants(self.cfg.output_dir, f"the shared trainer stopped ({why}); restarting the attempt")
                self.logger.warning(f"shared trainer restarted: the attempts of {ended or 'no tenant'} restart")
            self.launch(name)
            self.restarts[name] += 1

    def wind_down(self) -> None:
        self.stop.set()
        for fut in self.futures.values():
            concurrent.futures.wait([fut.wrapped_future], timeout=STOP_WAIT_S)


def _serve(procs: _Processes, deploy_dir: str, state: dict) -> None:
    for name in procs.urls:
        procs.launch(name)
    write_state(deploy_dir, "up", **state, restarts=procs.restarts)
    while not procs.stop.is_set():
        for name in procs.ended():
            if not procs.stop.is_set():
                procs.restart(name)
                write_state(deploy_dir, "up", **state, restarts=procs.restarts)


@flow(name="shared-deployment", log_prints=True)
def shared_deployment(config: dict) -> dict:
    """Serve the deployment in `config["output_dir"]` (DEPLOY_DIR) until it is stopped; returns its last state."""
    logger = get_run_logger()
    cfg = RunConfig.model_validate(config)
    if problems := shared_problems(cfg):
        raise ValueError("not a shared deployment profile:\n  " + "\n  ".join(problems))
    deploy_dir = cfg.output_dir
    fs, root = get_fs(deploy_dir, cfg.storage)
    fs.makedirs(root, exist_ok=True)
    clear_stop(deploy_dir)  # a stop file left from before asks the previous supervisor, not this one
    with hold_lease(fs, root, cfg.restart.lease_ttl_s, logger) as lease:
        run_id, stop, outcome = new_run_id(cfg), threading.Event(), "failed"
        lease.attach(stop)
        _watch_stop_file(deploy_dir, stop)
        logs = logs_dir(fs, root, run_id)
        procs = None
        try:
            write_state(deploy_dir, "starting", run_id=run_id)
            _backbone(cfg, run_id, logs, stop, logger)
            # one port for the deployment's life: deployment.json names it, restarts of the server keep it
            cfg.inference.port = cfg.inference.port or free_port(cfg.inference.host)
            url = f"http://{cfg.inference.host}:{cfg.inference.port}"
            procs = _Processes(cfg, write_process_configs(cfg, run_id, url), logs, stop, logger)
            logger.info(
                f"shared deployment {deploy_dir} serving at {url}; `rollflow shared down {deploy_dir}` stops it"
            )
            _serve(procs, deploy_dir, {"run_id": run_id, "inference_url": url})
            lease.raise_if_lost()
            outcome = "down"
        finally:
            stop.set()
            if procs is not None:
                procs.wind_down()
            write_state(deploy_dir, outcome, run_id=run_id, restarts=procs.restarts if procs else {})
            clear_stop(deploy_dir)
    logger.info(f"shared deployment {deploy_dir}: {outcome}")
    return {"deploy_dir": deploy_dir, "state": outcome, "restarts": procs.restarts if procs else {}}
