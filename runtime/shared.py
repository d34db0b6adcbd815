"""A shared deployment's bookkeeping (docs/multitenant.md), for `rollflow shared up|down|status` and the
`shared-deployment` flow (flows/shared.py), which supervises its two processes.

DEPLOY_DIR is laid out like a run directory:
    config/run.json               the profile it was started with (its [model] is the backbone tenants check)
    config/sft.json               the backbone's warm-up (publishes weights/step=000000, the backbone)
    config/inference.json         the shared inference server (InferenceProcessConfig with `shared`)
    config/shared_trainer.json    the shared trainer (SharedTrainerProcessConfig)
    deployment.json               DeploymentRecord (storage/tenants.py): what tenants attach to
    tenants/<name>.json           one TenantRecord per attached tenant run (written by the tenants' flows)
    shared_state.json             the supervisor's state: up / down / failed, its processes' restarts
    shared.stop                   `rollflow shared down` asks the supervisor to stop (it removes the file)
    logs/                         the processes' logs
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from config.process import ComponentPaths, InferenceProcessConfig, SharedTrainerProcessConfig, sft_config
from config.run import RunConfig
from config.tenant import DeploymentRecord, SharedConfig, SharedInferenceSettings, SharedTrainerStatus
from runtime.rundir import write_run_config
from storage import weights
from storage.fs import get_fs, is_committed, join, read_manifest, write_json
from storage.tenants import read_deployment, read_tenants, remove_tenant, write_deployment

STATE_FILE = "shared_state.json"
STOP_FILE = "shared.stop"
SHARED_COMPONENTS = {"inference": "engines.inference", "trainer": "engines.trainer.shared"}


SHARED_BACKENDS = ("embedded", "vllm")  # the backends whose capabilities say `shared` (docs/inference.md)


def shared_problems(cfg: RunConfig) -> list[str]:
    """What a deployment profile must change, each naming the key and the valid value."""
    problems = []
    if cfg.shared is None:
        problems.append("[shared] is not set: a shared deployment's profile needs it (max_tenants, max_lora_rank)")
    if cfg.model.lora is not None:
        problems.append("model.lora is set: the deployment's [model] is the backbone; tenants bring the adapters")
    if cfg.inference.backend not in SHARED_BACKENDS:
        problems.append(
            f"inference.backend = {cfg.inference.backend!r}: a shared server is one of {list(SHARED_BACKENDS)}"
        )
    if cfg.trainer.parallel.world_size != 1:
        problems.append(f"trainer.parallel.world_size = {cfg.trainer.parallel.world_size}: the shared trainer is 1")
    if cfg.teacher.enabled:
        problems.append(f"teacher.path = {cfg.teacher.path!r}: a shared deployment has no teacher")
    if cfg.weight_broadcast.type != "filesystem":
        problems.append(f"weight_broadcast.type = {cfg.weight_broadcast.type!r}: set 'filesystem'")
    return problems


def paths(cfg: RunConfig, run_id: str) -> ComponentPaths:
    return ComponentPaths(output_dir=cfg.output_dir, run_id=run_id, storage=cfg.storage)


def write_warmup_config(cfg: RunConfig, run_id: str) -> str:
    """config/run.json and config/sft.json (the backbone's warm-up); returns the latter's URL."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    write_run_config(cfg, run_id)
    write_json(fs, join(root, "config", "sft.json"), sft_config(cfg, paths(cfg, run_id)).model_dump(mode="json"))
    return cfg.output_dir.rstrip("/") + "/config/sft.json"


def backbone_committed(cfg: RunConfig) -> bool:
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    return is_committed(fs, weights.version_dir(root, 0))


def write_process_configs(cfg: RunConfig, run_id: str, inference_url: str) -> dict[str, str]:
    """config/inference.json, config/shared_trainer.json and deployment.json; returns component -> config URL."""
    assert cfg.shared is not None  # shared_problems refused the profile otherwise
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    here = paths(cfg, run_id)
    settings = SharedInferenceSettings(deploy_dir=cfg.output_dir, shared=cfg.shared)
    slices = {
        "inference": InferenceProcessConfig(
            run=here, model=cfg.model, inference=cfg.inference, seed=cfg.seed, shared=settings
        ),
        "shared_trainer": SharedTrainerProcessConfig(
            run=here, model=cfg.model, trainer=cfg.trainer, seed=cfg.seed, deploy_dir=cfg.output_dir, shared=cfg.shared
        ),
    }
    urls = {}
    for name, sub in slices.items():
        write_json(fs, join(root, "config", f"{name}.json"), sub.model_dump(mode="json"))
        urls[name] = cfg.output_dir.rstrip("/") + f"/config/{name}.json"
    write_deployment(cfg.output_dir, deployment_record(cfg, inference_url, cfg.shared))
    return {"inference": urls["inference"], "trainer": urls["shared_trainer"]}


def deployment_record(cfg: RunConfig, inference_url: str, shared: SharedConfig) -> DeploymentRecord:
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    backbone = weights.version_dir(root, 0)
    return DeploymentRecord(
        backbone_dir=cfg.output_dir.rstrip("/") + "/weights/step=000000",
        backbone_sha256=read_manifest(fs, backbone)["model_sha256"],
        inference_url=inference_url,
        max_tenants=shared.max_tenants,
        max_lora_rank=shared.max_lora_rank,
    )


def write_state(deploy_dir: str, state: str, **fields) -> None:
    """shared_state.json: `state` (starting, up, down, failed) with the supervisor's host, pid and `fields`."""
    fs, root = get_fs(deploy_dir)
    body = {"state": state, "host": socket.gethostname(), "pid": os.getpid(), "updated": time.time(), **fields}
    write_json(fs, join(root, STATE_FILE), body)


def read_state(deploy_dir: str) -> dict | None:
    fs, root = get_fs(deploy_dir)
    try:
        return json.loads(fs.cat_file(join(root, STATE_FILE)))
    except (FileNotFoundError, ValueError):
        return None


def request_stop(deploy_dir: str) -> None:
    fs, root = get_fs(deploy_dir)
    fs.pipe_file(join(root, STOP_FILE), b"stop\n")


def stop_requested(deploy_dir: str) -> bool:
    fs, root = get_fs(deploy_dir)
    return fs.exists(join(root, STOP_FILE))


def clear_stop(deploy_dir: str) -> None:
    fs, root = get_fs(deploy_dir)
    if fs.exists(join(root, STOP_FILE)):
        fs.rm(join(root, STOP_FILE))


def status(deploy_dir: str) -> dict:
    """What `rollflow shared status` prints: the supervisor's state, the deployment, each tenant's progress."""
    try:
        record = read_deployment(deploy_dir).model_dump(mode="json")
    except ValueError as exc:
        record = {"error": str(exc)}
    records, skipped = read_tenants(deploy_dir)
    tenants = {}
    for name, rec in records.items():
        fs, root = get_fs(rec.output_dir)
        try:
            trainer = SharedTrainerStatus.model_validate_json(fs.cat_file(join(root, "shared_trainer.json")))
            report = trainer.model_dump(mode="json") if trainer.attempt == rec.attempt else None
        except (FileNotFoundError, ValueError):
            report = None
        tenants[name] = {"output_dir": rec.output_dir, "attempt": rec.attempt, "trainer": report}
    return {"state": read_state(deploy_dir), "deployment": record, "tenants": tenants, "skipped": skipped}


def fail_tenants(deploy_dir: str, why: str) -> list[str]:
    """The shared trainer died: every attached tenant's attempt ends as if its own trainer had (its flow reads
    `failed` and restarts from its checkpoint, with a new record), and the records go before a new trainer starts,
    so that one never continues a tenant past a step the dead one left half done. Returns the tenants' names."""
    records, _ = read_tenants(deploy_dir)
    for name, record in records.items():
        fs, root = get_fs(record.output_dir)
        step = record.resume_step or 0
        status = SharedTrainerStatus(attempt=record.attempt, state="failed", step=step, error=why, updated=time.time())
        with contextlib.suppress(OSError):  # its storage is down: its flow's stall watch ends the attempt instead
            write_json(fs, join(root, "shared_trainer.json"), status.model_dump(mode="json"))
        remove_tenant(deploy_dir, name)
    return sorted(records)
