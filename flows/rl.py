"""The `rl` flow: run inference, orchestrator and trainer side by side until the trainer finishes
`max_steps`, restarting them from the last complete checkpoint when one dies; end with a summary.

Flow (this process)               subprocess tasks
  lease held for the whole run (lost: the attempt stops, nothing more is committed; runtime/lease.py)
  open or reopen the run
  attempt: prepare_attempt        (resume point, rollback, per-attempt configs)
           warm-up if needed ---> python -m engines.trainer --config config/sft.json   (version 0)
           components ----------> python -m engines.{inference,orchestrator,trainer} --config ...
                                  (+ a second engines.inference, "teacher", with a [teacher]: distillation)
  on a component failure: stop the rest, back off, next attempt (bounded by restart.max_restarts
  attempts in a row that make no checkpoint progress); a live component that makes no progress for its
  stall timeout (restart.stall, runtime/stall.py: the components' heartbeats) is a failure too; a component
  that exits EXIT_REFUSED (settings a restart cannot fix) ends the run at once
  while the attempts run: a watcher thread keeps the progress artifacts current (flows/progress.py)
  a tenant of a shared deployment (`tenant_of`): its attempts run its orchestrator only, against the
  deployment's server and trainer (flows/tenant.py, docs/multitenant.md)
  close the run: state.json (finished, failed or cancelled: flows/cancel.py), MLflow status, summary artifact
  (with the reward and evaluation curves)
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from config.cpus import CpuPlan
from config.process import EXIT_REFUSED, warmup_parallel
from config.run import RunConfig
from config.stall import HEARTBEAT_ENV
from config.transport import TRANSPORT_SECRET_ENV
from engines.protocol import ADMIN_TOKEN_ENV, TEACHER_TOKEN_ENV
from flows.cancel import outcome
from flows.progress import live_progress
from flows.tenant import run_tenant_attempt
from launch.slurm import srun_prefix, teacher_nodes
from launch.torchrun import rdzv_id, torchrun_args
from runtime.lease import LeaseKeeper, hold_lease
from runtime.lifecycle import RunHandle, close_run, continues_requeued_job, reopen_run, start_new_run
from runtime.process import ComponentFailed
from runtime.restarts import RestartBudget
from runtime.rundir import logs_dir
from runtime.slurm import allocation_nodes
from runtime.stall import StallWatch
from runtime.summary import summarize, to_markdown
from runtime.tenancy import Registration, SharedTarget, check_tenant, default_tenant_name
from runtime.walltime import WalltimeReached, WalltimeWatch
from storage.checkpoints import checkpoint_steps
from storage.fs import CONFIG_STORAGE_ENV, Storage, join
from storage.metrics import read_metrics
from storage.runstate import write_state
from tasks.components import run_component
from tasks.resume import Attempt, prepare_attempt


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
                    raise ComponentFailed(f"the trainer was stopped before finishing (exit code {fut.result()})")


class RunRefused(RuntimeError):
    """A component refused the run's settings (the orchestrator: a task whose first prompt cannot fit
    model.max_seq_len): a restart would too, so the run stops without one."""


def _component_env(cfg: RunConfig, tracking_uri: str | None) -> dict[str, dict[str, str]]:
    """Per-component environment: secrets (never in configs on disk, argv, or logs), and the storage
    settings each process needs to read its config file from `output_dir`."""
    beat = {HEARTBEAT_ENV: str(cfg.restart.stall.heartbeat_s)} if cfg.restart.stall.enabled else {}
    storage = {CONFIG_STORAGE_ENV: cfg.storage.model_dump_json(), **beat}  # every component's (heartbeat: stall watch)
    token = {ADMIN_TOKEN_ENV: secrets.token_hex(16)}  # admin routes of this attempt's engine
    teacher = secrets.token_hex(16)  # the teacher's own: the orchestrator checks the teacher holds it
    # the MAC key of this attempt's collective weight transport (engines/weight_transport.py)
    transport = {TRANSPORT_SECRET_ENV: secrets.token_hex(32)} if cfg.weight_broadcast.type == "collective" else {}
    tracking = {"MLFLOW_TRACKING_URI": tracking_uri} if tracking_uri else {}
    return {
        "warmup": storage,
        "inference": {**storage, **token, **transport},
        "teacher": {**storage, ADMIN_TOKEN_ENV: teacher},
        "orchestrator": {**storage, **token, TEACHER_TOKEN_ENV: teacher},
        "trainer": {**storage, **tracking, **transport},
    }


def _run_components(
    attempt: Attempt,
    logs: str,
    env: dict[str, dict[str, str]],
    placed: Placement,
    watch: WalltimeWatch,
    logger,
    lease: LeaseKeeper,
    stall: StallWatch | None = None,
) -> None:
    """Warm-up to completion if needed, then inference, orchestrator and trainer side by side, where
    `placed` puts them (srun job steps inside a Slurm job) and launched by torchrun where they have ranks.
    `stall`: this attempt's watch of their heartbeats; a component stuck by its rules fails the attempt."""
    srun = placed.srun
    stop = threading.Event()
    watch.attach(stop)
    lease.attach(stop)  # a lost lease stops the attempt at once
    try:
        if attempt.needs_warmup:
            log = join(logs, "warmup.log")
            module, url = attempt.modules["warmup"], attempt.urls["sft"]
            launcher = placed.warmup_launcher
            run_component("warmup", module, url, env["warmup"], log, stop, srun.get("warmup"), None, launcher, stall)
            if stop.is_set():
                raise ComponentFailed("stopped during the warm-up")
        watch.trainer_running.set()
        futures = {
            name: run_component.submit(
                name,
                attempt.modules[name],
                attempt.urls[name],
                env[name],
                join(logs, f"{name}.log"),
                stop,
                srun.get(name),
                watch.checkpoint_request if name == "trainer" else None,
                placed.trainer_launcher if name == "trainer" else None,
                stall,
            )
            for name in ("inference", "teacher", "orchestrator", "trainer")
            if name in attempt.urls  # the teacher's server runs only with a [teacher] (distillation)
        }
        _supervise(futures, stop, logger)
    finally:
        stop.set()
        watch.trainer_running.clear()


@dataclass
class Placement:
    """Where this attempt's components run: inside a Slurm job, srun job steps on the allocation's nodes."""

    srun: dict[str, list[str]]  # component -> its job-step prefix; empty locally
    inference_node: str | None  # the node the orchestrator reaches inference on; None: beside it (locally too)
    trainer_launcher: list[str]  # torchrun's arguments when the trainer has ranks (one agent per trainer node)
    warmup_launcher: list[str]  # the warm-up's, on the first trainer node (config.process.warmup_parallel)
    trainer_nodes: list[str] = field(default_factory=list)  # several: agents meet under a per-attempt id
    cpus: CpuPlan = field(default_factory=CpuPlan)  # locally: the cores of each component (config/cpus.py)

    def for_attempt(self, cfg: RunConfig, run_id: str, attempt: int) -> Placement:
        """This placement with the trainer's rendezvous id of this run and attempt (launch/torchrun.py)."""
        if len(self.trainer_nodes) <= 1:
            return self
        p = cfg.trainer.parallel
        launcher = torchrun_args(p.world_size, self.trainer_nodes, p.rdzv_port, rdzv_id(run_id, attempt))
        return replace(self, trainer_launcher=launcher)


def _placement(cfg: RunConfig, logger) -> Placement:
    p, warmup = cfg.trainer.parallel, torchrun_args(warmup_parallel(cfg).world_size)
    nodes = allocation_nodes(cfg.placement)
    if nodes is None:
        cpus = cfg.cpu_plan(os.sched_getaffinity(0))
        logger.info(cpus.describe())
        return Placement({}, None, torchrun_args(p.world_size), warmup, cpus=cpus)
    logger.info("Slurm placement: " + ", ".join(f"{k} on {','.join(v)}" for k, v in nodes.items()))
    srun = {name: srun_prefix(name, n, cfg.placement.slurm) for name, n in nodes.items()}
    if cfg.teacher.enabled:  # the teacher's server beside the first inference server
        srun["teacher"] = srun_prefix("teacher", teacher_nodes(nodes), cfg.placement.slurm)
    trainer = torchrun_args(p.world_size, nodes["trainer"], p.rdzv_port)
    # The orchestrator reaches inference by its node's name only from another node: a name that may resolve to
    # an address the engine does not serve on when both share one (a one-node job).
    engine = nodes["inference"][0] if nodes["inference"][0] != nodes["orchestrator"][0] else None
    return Placement(srun, engine, trainer, warmup, nodes["trainer"])


def _attempts(
    cfg: RunConfig,
    storage: Storage,
    run: RunHandle,
    logger,
    watch: WalltimeWatch,
    lease: LeaseKeeper,
    shared: SharedTarget | None = None,
) -> None:
    """Attempt after attempt until the trainer finishes; give up after `max_restarts` failures in a row
    that each restarted from the same checkpoint. Slurm's walltime warning ends them (resumable).
    `shared`: a tenant run of a shared deployment (flows/tenant.py); its record is removed when the run ends."""
    tenant = Registration(shared, cfg.output_dir, run.run_id) if shared is not None else None
    try:
        _attempt_loop(cfg, storage, run, logger, watch, lease, tenant)
    finally:
        if tenant is not None:
            tenant.detach()


def _attempt_loop(cfg, storage, run, logger, watch, lease, tenant: Registration | None) -> None:
    budget = RestartBudget(cfg.restart)
    fs, root = storage.open(cfg.output_dir)
    logs = logs_dir(fs, root, run.run_id)
    placed = _placement(cfg, logger)
    shared = tenant.target if tenant is not None else None
    while True:
        if watch.reached.is_set():
            raise WalltimeReached("the Slurm job's time limit is near; the run is left to resume-unfinished")
        attempt = prepare_attempt(
            cfg, run.run_id, run.tracking_uri, run.state.mlflow_run_id, placed.inference_node, shared
        )
        run.state.attempts += 1
        write_state(fs, root, run.state)
        budget.attempt_from(attempt.resume_step)
        try:
            env = {k: {**v, **placed.cpus.env(k)} for k, v in _component_env(cfg, run.tracking_uri).items()}
            if tenant is not None:
                number, stall_cfg = run.state.attempts, cfg.restart.stall
                run_tenant_attempt(attempt, number, tenant, logs, env["orchestrator"], watch, lease, stall_cfg, logger)
                return
            here = placed.for_attempt(cfg, run.run_id, run.state.attempts)
            stall = StallWatch(cfg.restart.stall) if cfg.restart.stall.enabled else None
            _run_components(attempt, logs, env, here, watch, logger, lease, stall)
            return
        except ComponentFailed as exc:
            lease.raise_if_lost()
            if exc.returncode == EXIT_REFUSED:
                raise RunRefused(str(exc)) from None
            if watch.reached.is_set():
                raise WalltimeReached(
                    "stopped at the Slurm job's walltime warning; the run is unfinished and resumable "
                    "(resume-unfinished continues it from its last checkpoint)"
                ) from None
            delay = budget.failed(exc)
            logger.warning(budget.notice(exc, delay))
            watch.reached.wait(delay)


@flow(name="rl", log_prints=True)
def rl(
    config: dict, overwrite: bool = False, resume: bool = False, tenant_of: str | None = None, tenant: str | None = None
) -> dict:
    """`tenant_of`: run as a tenant of the shared deployment in that directory (docs/multitenant.md), named
    `tenant` (default: the run's name)."""
    logger = get_run_logger()
    t0 = time.time()
    cfg = RunConfig.model_validate(config)
    shared = check_tenant(cfg, tenant_of, tenant or default_tenant_name(cfg)) if tenant_of else None
    storage = Storage(cfg.storage)
    fs, root = storage.open(cfg.output_dir)
    fs.makedirs(root, exist_ok=True)
    checkpoints = lambda: checkpoint_steps(fs, root)  # noqa: E731 - what the walltime watch waits for
    with hold_lease(fs, root, cfg.restart.lease_ttl_s, logger) as lease, WalltimeWatch(logger, checkpoints) as watch:
        resume = resume or continues_requeued_job(cfg, logger)
        run = reopen_run(cfg, logger) if resume else start_new_run(cfg, overwrite)
        logger.info(f"run {run.run_id} -> {cfg.output_dir}" + (" (resumed)" if resume else ""))
        finished = False
        try:
            with live_progress(fs, root, cfg.max_steps, run.run_id, logger):
                _attempts(cfg, storage, run, logger, watch, lease, shared)
            finished = True
        finally:
            close_run(cfg, run, outcome(finished, logger))
    summary = summarize(fs, root, cfg.output_dir, time.time() - t0)
    report = to_markdown(summary, read_metrics(fs, root))
    create_markdown_artifact(report, key="rl-run-summary", description=f"run {run.run_id}")
    logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary
