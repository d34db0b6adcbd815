"""One attempt of a tenant run on a shared deployment (docs/multitenant.md), in place of flows/rl.py's
`_run_components`: the run's only process is its orchestrator; its trainer is the deployment's.

    record D/tenants/NAME.json (attempt, resume step, token SHA-256) -> the shared server and trainer follow it
    orchestrator ------> python -m engines.orchestrator --config T/config/orchestrator.json   (TENANT_TOKEN_ENV)
    every POLL_S: T/shared_trainer.json (SharedTrainerWatch) -> finished: the attempt ends; failed or stalled:
                  the attempt fails (the rl flow's restart budget decides what follows)
The record stays across attempts (each rewrites it with a higher attempt); the rl flow removes it when the run
ends, so a SIGKILLed tenant's record stays until its resume takes it over.
"""

from __future__ import annotations

import threading

from config.stall import StallConfig
from config.tenant import TENANT_TOKEN_ENV
from engines.protocol import ADMIN_TOKEN_ENV, TEACHER_TOKEN_ENV
from runtime.lease import LeaseKeeper
from runtime.process import ComponentFailed
from runtime.stall import StallWatch
from runtime.tenancy import Registration, SharedTrainerWatch
from runtime.walltime import WalltimeWatch
from storage.fs import get_fs, join
from tasks.components import run_component
from tasks.resume import Attempt

POLL_S = 0.5


def tenant_env(env: dict[str, str], token: str) -> dict[str, str]:
    """The orchestrator's environment as a tenant: its tenant token instead of an engine's admin token."""
    return {k: v for k, v in env.items() if k not in (ADMIN_TOKEN_ENV, TEACHER_TOKEN_ENV)} | {TENANT_TOKEN_ENV: token}


def run_tenant_attempt(
    attempt: Attempt,
    number: int,
    registration: Registration,
    logs: str,
    env: dict[str, str],
    watch: WalltimeWatch,
    lease: LeaseKeeper,
    stall_cfg: StallConfig,
    logger,
) -> None:
    """Register attempt `number`, run the orchestrator, and return once the shared trainer finished the run;
    ComponentFailed (or ComponentStalled) when either side fails or stops."""
    cfg_url, output_dir = attempt.urls["orchestrator"], registration.output_dir
    number = registration.attach(number, attempt.resume_step)
    logger.info(f"tenant {registration.target.name!r} attempt {number} on {registration.target.deploy_dir}")
    stop = threading.Event()
    watch.attach(stop)
    lease.attach(stop)
    fs, root = get_fs(output_dir)
    trainer = SharedTrainerWatch(fs, root, number, stall_cfg)
    stall = StallWatch(stall_cfg) if stall_cfg.enabled else None
    orch = run_component.submit(
        "orchestrator",
        attempt.modules["orchestrator"],
        cfg_url,
        tenant_env(env, registration.token),
        join(logs, "orchestrator.log"),
        stop,
        None,
        None,
        None,
        stall,
    )
    try:
        _wait(orch, trainer, stop, logger)
    finally:
        stop.set()
        orch.wait()


def _wait(orch, trainer: SharedTrainerWatch, stop: threading.Event, logger) -> None:
    """Until the shared trainer reports this attempt finished; the orchestrator failing fails the attempt."""
    orchestrator_done = False
    while not stop.is_set():
        if trainer.check(judge_waiting=orchestrator_done):
            logger.info(f"the shared trainer finished this tenant at step {trainer.last.step if trainer.last else '?'}")
            return
        if not orchestrator_done and orch.wrapped_future.done():
            orch.wait()
            if not orch.state.is_completed():
                orch.result()  # raises the orchestrator's error
            orchestrator_done = True
            logger.info("every rollout step is committed; waiting for the shared trainer to train the last ones")
        stop.wait(POLL_S)
    raise ComponentFailed("the attempt was stopped before the shared trainer finished")
