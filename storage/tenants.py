"""Read and write a shared deployment's tenant records (config/tenant.py) in DEPLOY_DIR.

Writers (a tenant's flow) write `tenants/<name>.json` atomically and remove it when the run ends. Readers (the
shared inference server and trainer) list the directory every poll: a file whose name is not a tenant name, or
whose content does not validate, or whose `name` differs from its file name is skipped and reported, never
followed, so a stray or hostile file cannot stop or redirect the deployment.
"""

from __future__ import annotations

import json
import logging
import os

from pydantic import ValidationError

from config.tenant import TENANT_NAME_RE, DeploymentRecord, SharedTrainerStatus, TenantRecord, check_tenant_name
from storage.fs import get_fs, join, read_json, write_json

log = logging.getLogger("rollflow.tenants")

DEPLOYMENT_FILE = "deployment.json"
TENANTS_DIR = "tenants"
STATUS_FILE = "shared_trainer.json"  # in a tenant's OUTPUT_DIR: the shared trainer's word on it


def tenant_path(deploy_dir: str, name: str) -> str:
    return join(deploy_dir, TENANTS_DIR, f"{check_tenant_name(name)}.json")


def write_tenant(deploy_dir: str, record: TenantRecord) -> None:
    fs, root = get_fs(deploy_dir)
    write_json(fs, tenant_path(root, record.name), record.model_dump(mode="json"))


def remove_tenant(deploy_dir: str, name: str) -> None:
    fs, root = get_fs(deploy_dir)
    path = tenant_path(root, name)
    if fs.exists(path):
        fs.rm(path)


def read_tenants(deploy_dir: str) -> tuple[dict[str, TenantRecord], list[str]]:
    """({name: record} of every valid record, [why each other file was skipped])."""
    fs, root = get_fs(deploy_dir)
    directory = join(root, TENANTS_DIR)
    records: dict[str, TenantRecord] = {}
    skipped: list[str] = []
    if not fs.exists(directory):
        return records, skipped
    for path in sorted(fs.ls(directory, detail=False)):
        base = os.path.basename(path.rstrip("/"))
        stem = base[: -len(".json")] if base.endswith(".json") else ""
        if not TENANT_NAME_RE.match(stem) or base != f"{stem}.json":
            if not base.startswith("."):  # write_bytes_atomic's temp files
                skipped.append(f"{path}: not a tenant record name (<tenant>.json)")
            continue
        try:
            record = TenantRecord.model_validate_json(fs.cat_file(path))
        except (ValidationError, OSError, ValueError) as exc:
            skipped.append(f"{path}: {str(exc).splitlines()[0]}")
            continue
        if record.name != stem:
            skipped.append(f"{path}: holds tenant {record.name!r}, not {stem!r}")
            continue
        records[stem] = record
    for why in skipped:
        log.warning(f"tenant record skipped: {why}")
    return records, skipped


def write_deployment(deploy_dir: str, record: DeploymentRecord) -> None:
    fs, root = get_fs(deploy_dir)
    write_json(fs, join(root, DEPLOYMENT_FILE), record.model_dump(mode="json"))


def read_deployment(deploy_dir: str) -> DeploymentRecord:
    """The deployment's record; ValueError naming the file when it is missing or invalid."""
    path = join(deploy_dir, DEPLOYMENT_FILE)
    try:
        return DeploymentRecord.model_validate(read_json(path))
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: no shared deployment here (start one with `rollflow shared up`)") from exc
    except (ValidationError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a valid deployment record: {exc}") from exc


def write_status(output_dir: str, status: SharedTrainerStatus) -> None:
    """The shared trainer's status of a tenant, in the tenant's OUTPUT_DIR (atomically)."""
    fs, root = get_fs(output_dir)
    write_json(fs, join(root, STATUS_FILE), status.model_dump(mode="json"))


def read_status(output_dir: str) -> SharedTrainerStatus | None:
    """The tenant's status; None while the shared trainer has written none (or a half-written one is absent)."""
    try:
        return SharedTrainerStatus.model_validate(read_json(join(output_dir, STATUS_FILE)))
    except FileNotFoundError:
        return None
