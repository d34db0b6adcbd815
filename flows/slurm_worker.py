"""A Prefect worker type for Slurm clusters, over the Slurm CLI (Slurm >= 22.05; no slurmrestd).

    prefect work-pool create NAME --type rollflow-slurm
    prefect worker start --pool NAME        (on a login node: sbatch, squeue, scontrol, scancel on PATH)

Per flow run: the base job template's variables (partition, nodes, time limit, ...) resolve into a
`SlurmJobConfiguration`; `run` renders one batch script (launch/slurm.py) that runs the flow with
`python -m prefect.engine`, submits it with `sbatch` and logs the job id to the flow run. It then follows
the job (squeue, then scontrol / sacct) until it ends; on the way a Prefect cancellation becomes
`scancel`, and a job that ends while its flow run is not final (killed, node failure, out of memory,
walltime without the warning) marks the flow run Crashed with Slurm's state. An sbatch rejection fails
the flow run with Slurm's message; nothing was started. Before that, the job variables (which anyone who
can reach the Prefect API may set) pass the profile's own checks of what may be written into the script
(config/script_text.py); one that does not fails the flow run and never reaches sbatch. `setup` and
`command` are shell by design: whoever can set them can run code on the cluster (docs/slurm.md).
Prefect finds this type through the `prefect.collections` entry point in pyproject.toml.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, Crashed, Failed
from prefect.utilities.asyncutils import run_sync_in_worker_thread
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field, ValidationError

from config.placement import SlurmJobConfig
from config.script_text import ENV_VALUE, FLOW_RUN_NAME, PATH_TEXT, Charset, check_env_key, check_name
from launch.slurm import render_sbatch
from runtime import slurm

WORKER_TYPE = "rollflow-slurm"
SETTLE_S, SETTLE_POLL_S = 20.0, 0.5  # how long, and how often, a cancelled run is kept Cancelled after its job
_DEFAULTS = SlurmJobConfig()


class SlurmVariables(BaseVariables):
    """What a work pool, a deployment or one flow run ("Run with parameters") can set."""

    partition: str | None = Field(default=None, description="Slurm partition (sbatch --partition); empty: default")
    account: str | None = Field(default=None, description="Slurm account to charge (sbatch --account)")
    qos: str | None = Field(default=None, description="quality of service (sbatch --qos)")
    nodes: int = Field(default=1, ge=1, description="nodes of the job: the profile's deployment.nodes")
    gpus_per_node: int = Field(default=0, ge=0, description="GPUs per node (sbatch --gpus-per-node)")
    cpus_per_task: int = Field(default=_DEFAULTS.cpus_per_task, ge=1, description="CPUs per node")
    mem: str = Field(default=_DEFAULTS.mem, description="memory per node (sbatch --mem, e.g. 64G)")
    time_limit: str = Field(default=_DEFAULTS.time_limit, description="walltime (sbatch --time, e.g. 04:00:00)")
    signal_before_s: int = Field(
        default=_DEFAULTS.signal_before_s, ge=0, description="walltime warning: USR1 this many seconds before"
    )
    extra_sbatch: list[str] = Field(default_factory=list, description="more sbatch options, e.g. --exclusive")
    setup: list[str] = Field(default_factory=list, description="shell lines before the flow (module load, ...)")
    working_dir: str | None = Field(default=None, description="the job's directory; empty: the worker's")
    script_dir: str = Field(default="slurm-jobs", description="where batch scripts and job output are written")
    poll_interval_s: float = Field(default=5.0, gt=0, description="how often the worker asks Slurm about the job")


class SlurmJobConfiguration(BaseJobConfiguration):
    partition: str | None = Field(default=None)
    account: str | None = Field(default=None)
    qos: str | None = Field(default=None)
    nodes: int = Field(default=1)
    gpus_per_node: int = Field(default=0)
    cpus_per_task: int = Field(default=_DEFAULTS.cpus_per_task)
    mem: str = Field(default=_DEFAULTS.mem)
    time_limit: str = Field(default=_DEFAULTS.time_limit)
    signal_before_s: int = Field(default=_DEFAULTS.signal_before_s)
    extra_sbatch: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list)
    working_dir: str | None = Field(default=None)
    script_dir: str = Field(default="slurm-jobs")
    poll_interval_s: float = Field(default=5.0)

    @staticmethod
    def _base_flow_run_command() -> str:
        return f"{sys.executable} -m prefect.engine"

    def slurm_config(self) -> SlurmJobConfig:
        """The job variables as the sbatch request, validated by the profile's own model (the characters
        that may reach the script, the time and memory syntax): ValidationError otherwise. Whether the
        cluster has that partition, those nodes, that much time is Slurm's to judge (its message reaches
        the flow run)."""
        keys = ["partition", "account", "qos", "gpus_per_node", "cpus_per_task", "mem", "time_limit"]
        keys += ["signal_before_s", "extra_sbatch", "setup"]
        return SlurmJobConfig.model_validate({k: getattr(self, k) for k in keys})


class SlurmWorkerResult(BaseWorkerResult):
    """The job id, and 0 when the job and its flow run ended normally."""


class JobVariablesRefused(ValueError):
    """A job variable (or the flow run's name) cannot be written into the batch script."""


def _problem(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        reason = err.get("ctx", {}).get("error") or err["msg"]  # a validator's own message, without pydantic's prefix
        out.append(f"job variable {'.'.join(str(p) for p in err['loc'])}: {reason}")
    return out


def _check_text(what: str, value: str, charset: Charset) -> list[str]:
    try:
        check_name(value, charset)
    except ValueError as exc:
        return [f"{what}: {exc}"]
    return []


def checked_job(configuration: SlurmJobConfiguration, flow_run: FlowRun) -> tuple[SlurmJobConfig, dict[str, str]]:
    """The sbatch request and the job's environment, once every value that the script will carry passed
    the same checks as a profile (config/script_text.py); JobVariablesRefused lists every one that did not.
    Job variables come from whoever can reach the Prefect API: none reaches sbatch unchecked."""
    problems: list[str] = []
    try:
        request = configuration.slurm_config()
    except ValidationError as exc:
        problems += _problem(exc)
    env = {k: v for k, v in configuration.env.items() if v is not None}
    for key, value in env.items():
        try:
            check_env_key(key)
        except ValueError as exc:
            problems.append(f"job variable env: {exc}")
        problems += _check_text(f"job variable env.{key}", value, ENV_VALUE)
    for key in ("working_dir", "script_dir"):
        if getattr(configuration, key):
            problems += _check_text(f"job variable {key}", getattr(configuration, key), PATH_TEXT)
    problems += _check_text("the flow run's name (it names the Slurm job)", flow_run.name, FLOW_RUN_NAME)
    if problems:
        raise JobVariablesRefused("; ".join(problems))
    return request, env


def _write_script(configuration: SlurmJobConfiguration, flow_run: FlowRun) -> Path:
    """The flow run's batch script, `script_dir/<flow run id>.sbatch`; JobVariablesRefused before anything
    is written if a value may not reach it."""
    request, env = checked_job(configuration, flow_run)
    workdir = Path(configuration.working_dir or os.getcwd()).resolve()
    script_dir = (workdir / configuration.script_dir).resolve()
    script_dir.mkdir(parents=True, exist_ok=True)
    text = render_sbatch(
        request,
        configuration.nodes,
        f"prefect-{flow_run.name}",
        configuration.command or configuration._base_flow_run_command(),
        env,
        str(script_dir / f"{flow_run.id}-%j.out"),
    )
    path = script_dir / f"{flow_run.id}.sbatch"
    slurm.write_script(path, text)  # mode 0600: it carries the Prefect API settings
    return path


class SlurmWorker(BaseWorker[SlurmJobConfiguration, SlurmVariables, SlurmWorkerResult]):
    type = WORKER_TYPE
    job_configuration = SlurmJobConfiguration
    job_configuration_variables = SlurmVariables
    _description = "Run each flow run as one Slurm job (sbatch), followed with squeue; cancel = scancel."
    _display_name = "Slurm (rollflow)"
    _documentation_url = "https://github.com/rollflow/rollflow/blob/main/docs/slurm.md"

    async def setup(self) -> None:
        for command in ("sbatch", "squeue", "scontrol", "scancel"):
            slurm.require(command)  # a worker that cannot reach Slurm says so before taking runs
        await super().setup()

    async def run(
        self,
        flow_run: FlowRun,
        configuration: SlurmJobConfiguration,
        task_status: anyio.abc.TaskStatus[Any] | None = None,
    ) -> SlurmWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        try:
            script = _write_script(configuration, flow_run)
        except JobVariablesRefused as exc:
            return await self._refuse(flow_run, f"the Slurm worker refused the job: {exc}", logger, task_status)
        try:
            job_id = await run_sync_in_worker_thread(slurm.submit, str(script), configuration.working_dir)
        except slurm.SbatchRejected as exc:
            return await self._refuse(flow_run, f"sbatch rejected the job: {exc}", logger, task_status)
        logger.info(f"submitted Slurm job {job_id} ({script})")
        if task_status is not None:
            task_status.started(job_id)
        return await self._follow(flow_run, job_id, configuration.poll_interval_s, logger)

    async def _refuse(self, flow_run: FlowRun, message: str, logger, task_status) -> SlurmWorkerResult:
        """No job was created: the flow run fails with `message`."""
        logger.error(message)
        await self._set_final(flow_run, Failed(message=message))
        if task_status is not None:
            task_status.started(RuntimeError(message))  # an exception: Prefect records no infrastructure id
        return SlurmWorkerResult(identifier="rejected", status_code=0)

    async def _follow(self, flow_run: FlowRun, job_id: str, poll_s: float, logger) -> SlurmWorkerResult:
        """Poll Slurm and the flow run until the job is gone; scancel on a Prefect cancellation."""
        last, cancelled = None, False
        while True:
            try:
                state, reason = await anyio.to_thread.run_sync(slurm.job_state, job_id)
            except slurm.SlurmTimeout as exc:  # Slurm not answering is no news of the job: poll again
                logger.warning(f"Slurm job {job_id}: {exc}; polling again in {poll_s:.0f}s")
                await anyio.sleep(poll_s)
                continue
            if state != last:
                logger.info(f"Slurm job {job_id}: {state}" + (f" ({reason})" if reason else ""))
                last = state
            if state not in slurm.ACTIVE_STATES:
                break
            if state == "PENDING" and reason in slurm.NEVER_STARTS:
                await run_sync_in_worker_thread(slurm.cancel, job_id)
                message = f"Slurm will never start job {job_id} (pending: {reason}); cancelled it"
                logger.error(message)
                await self._set_final(flow_run, Failed(message=message))
                return SlurmWorkerResult(identifier=job_id, status_code=0)
            run = await self.client.read_flow_run(flow_run.id)
            if not cancelled and run.state is not None and (run.state.is_cancelling() or run.state.is_cancelled()):
                logger.info(f"flow run cancelled in Prefect: scancel {job_id}")
                await run_sync_in_worker_thread(slurm.cancel, job_id)
                cancelled = True
            await anyio.sleep(poll_s)
        return await self._settle(flow_run, job_id, state, reason, cancelled)

    async def _settle(
        self, flow_run: FlowRun, job_id: str, state: str | None, reason: str | None, cancelled: bool
    ) -> SlurmWorkerResult:
        """The job is over: make sure its flow run ends in a final state that says what happened."""
        run = await self.client.read_flow_run(flow_run.id)
        if cancelled:
            await self._keep_cancelled(flow_run, job_id)
            return SlurmWorkerResult(identifier=job_id, status_code=0)
        if run.state is not None and run.state.is_final():
            return SlurmWorkerResult(identifier=job_id, status_code=0)
        message = f"Slurm job {job_id} ended ({state or 'unknown'}, {reason or 'no details'}) before its flow reported"
        await self._set_final(flow_run, Crashed(message=message))
        return SlurmWorkerResult(identifier=job_id, status_code=0)

    async def _keep_cancelled(self, flow_run: FlowRun, job_id: str) -> None:
        """A cancelled run ends Cancelled. Its flow process reports the termination signal as a crash, and may
        do so after Slurm counts the job as gone (a process the batch shell leaves behind is not tracked), so
        for SETTLE_S the run is put back to Cancelled whenever it is not."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            run = await self.client.read_flow_run(flow_run.id)
            if run.state is None or not run.state.is_cancelled():
                await self._set_final(flow_run, Cancelled(message=f"cancelled: Slurm job {job_id} was scancel'ed"))
            if time.monotonic() >= deadline:
                return
            await anyio.sleep(SETTLE_POLL_S)

    async def _set_final(self, flow_run: FlowRun, state: Any) -> None:
        await self.client.set_flow_run_state(flow_run.id, state, force=True)

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: SlurmJobConfiguration, grace_seconds: int = 30
    ) -> None:
        """A run cancelled while its job is still queued: scancel it."""
        await run_sync_in_worker_thread(slurm.cancel, infrastructure_pid)
