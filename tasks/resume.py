"""Before each attempt (first start, in-flow restart or resume): choose the checkpoint to restart
from, roll the run directory back to it, and write the components' configs for this attempt."""

from __future__ import annotations

from dataclasses import dataclass, replace

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from config.registry import COMPONENT_MODULES
from config.run import RunConfig
from engines.inference.backend import launch_plan, teacher_plan
from runtime.rundir import free_port, write_configs
from runtime.tenancy import SharedTarget, copy_backbone, retire
from storage import weights
from storage.fs import get_fs, is_committed
from storage.resume import repair, resume_point, rollback
from storage.tenants import read_deployment


@dataclass
class Attempt:
    resume_step: int | None  # trainer checkpoint restarted from; None: from the warm-up's version 0
    needs_warmup: bool  # no committed version 0 yet: the warm-up (SFT) runs first
    urls: dict[str, str]  # component -> config URL for this attempt
    modules: dict[str, str]  # component -> entry module


@task(cache_policy=NONE)
def prepare_attempt(
    cfg: RunConfig,
    run_id: str,
    tracking_uri: str | None,
    mlflow_run_id: str | None,
    inference_node: str | None = None,
    shared: SharedTarget | None = None,
) -> Attempt:
    """`shared`: a tenant run of a shared deployment (docs/multitenant.md): version 0 is a checked copy of the
    deployment's backbone instead of a warm-up, and the orchestrator talks to the deployment's server as the
    tenant. `inference_node`: inside a Slurm job whose orchestrator runs on another node than the engine, the
    engine's node (flows/rl.py `_placement`): the engine binds its address and the orchestrator reaches it by
    that name. None: the engine serves on `inference.host` (loopback by default) beside the orchestrator.
    Not a comparison with the flow's own host: the flow runs on the job's first node, which is the inference
    node itself on several nodes, while the orchestrator sits on the trainer's first node."""
    logger = get_run_logger()
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    if shared is not None:
        shared = _retire_previous(cfg, shared, logger)
    step = resume_point(fs, root, logger.warning)
    for what in rollback(fs, root, step):
        logger.info(f"rolled back: removed {what}")
    repair(fs, root, step, logger.warning)
    if shared is not None:
        return _tenant_attempt(cfg, run_id, tracking_uri, mlflow_run_id, step, shared, logger)
    attempt_cfg = cfg.model_copy(deep=True)
    attempt_cfg.inference.port = cfg.inference.port or free_port(cfg.inference.host)
    if cfg.weight_broadcast.type == "collective":  # a fresh rendezvous port each attempt, like the engine's
        attempt_cfg.weight_broadcast.port = cfg.weight_broadcast.port or free_port(cfg.weight_broadcast.host)
    teacher = attempt_cfg.teacher.inference
    if cfg.teacher.enabled:
        teacher.port = teacher.port or free_port(teacher.host)
    if inference_node:
        attempt_cfg.inference.host = inference_node  # another node: serve on, and connect to, its name
        teacher.host = inference_node  # the teacher's server runs beside the first inference server
    url = f"http://{attempt_cfg.inference.host}:{attempt_cfg.inference.port}"
    plan = launch_plan(attempt_cfg) | teacher_plan(attempt_cfg)
    urls = write_configs(attempt_cfg, run_id, url, tracking_uri, mlflow_run_id, step, plan)
    needs_warmup = step is None and not is_committed(fs, weights.version_dir(root, 0))
    logger.info(f"starting from {'checkpoint step=' + str(step) if step is not None else 'policy version 0'}")
    return Attempt(step, needs_warmup, urls, dict(COMPONENT_MODULES))


def _retire_previous(cfg: RunConfig, shared: SharedTarget, logger) -> SharedTarget:
    """A tenant attempt's first move: the deployment as deployment.json says now (brought down and up again, its
    port moved), and the previous attempt let go by the shared trainer before anything is rolled back."""
    shared = replace(shared, deployment=read_deployment(shared.deploy_dir))
    if not retire(shared, cfg.output_dir, cfg.restart.stall.trainer_s):
        logger.warning("the shared trainer did not confirm it let the previous attempt go; rolling back anyway")
    return shared


def _tenant_attempt(
    cfg: RunConfig,
    run_id: str,
    tracking_uri: str | None,
    mlflow_run_id: str | None,
    step: int | None,
    shared: SharedTarget,
    logger,
) -> Attempt:
    """Version 0 copied from the backbone unless present; the orchestrator's and the trainer's configs only."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    if copy_backbone(shared.deploy_dir, shared.deployment, fs, root):
        logger.info(f"version 0: copied the backbone {shared.deployment.backbone_dir} (model_sha256 checked)")
    url = shared.deployment.inference_url
    urls = write_configs(cfg, run_id, url, tracking_uri, mlflow_run_id, step, tenant=shared.name)
    wanted = {name: urls[name] for name in ("orchestrator", "trainer")}
    return Attempt(step, False, wanted, dict(COMPONENT_MODULES))
