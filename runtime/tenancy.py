"""A tenant run's side of a shared deployment (docs/multitenant.md): what `rollflow rl --tenant-of D` checks
before it starts and what its flow does around its one process, the orchestrator.

    profile -> tenant_problems (against D's backbone and deployment.json)   refused at load, exit code 2
    attempt -> copy_backbone (D/weights/step=0 -> T/weights/step=0, model_sha256 checked)
            -> retire (the previous attempt's record, once the shared trainer let it go), rollback
    -> Registration.attach (D/tenants/NAME.json, its token's SHA-256; the token itself by environment)
            -> the orchestrator runs; SharedTrainerWatch reads T/shared_trainer.json as the run's trainer
            -> Registration.detach (the run ended: finished, failed or cancelled)

Nothing here imports Prefect: flows/tenant.py drives it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from config.model import ModelConfig
from config.run import RunConfig
from config.stall import StallConfig
from config.tenant import DeploymentRecord, SharedTrainerStatus, TenantRecord, check_tenant_name
from runtime.process import ComponentFailed, ComponentStalled
from runtime.shared import read_state
from storage import weights
from storage.fs import MANIFEST_CHECKSUM, commit_dir, get_fs, is_committed, join, read_json, read_manifest
from storage.fs import read_verified as read_file
from storage.tenants import read_deployment, read_tenants, remove_tenant, write_tenant

# T/shared_trainer.json: the shared trainer's report on the tenant; DEPLOY_DIR/shared_trainer.json: its summary
STATUS_FILE = "shared_trainer.json"


class TenantError(ValueError):
    """The tenant run cannot attach to the deployment as asked (the message says what to change)."""


@dataclass(frozen=True)
class SharedTarget:
    """Where a tenant attempt runs: the deployment directory, its record, and the tenant's name there."""

    deploy_dir: str
    deployment: DeploymentRecord
    name: str


def default_tenant_name(cfg: RunConfig) -> str:
    """The run's name as a tenant name (lowercase, '_' and '.' as '-'), when it reads as one."""
    name = re.sub(r"[_.]", "-", cfg.run_name.lower())[:32]
    try:
        return check_tenant_name(name)
    except ValueError:
        raise TenantError(f"run_name {cfg.run_name!r} does not make a tenant name; pass --tenant NAME") from None


def backbone_model(deploy_dir: str) -> ModelConfig:
    """The deployment's [model] (its backbone), from D/config/run.json as `rollflow shared up` wrote it."""
    path = join(deploy_dir, "config", "run.json")
    try:
        return ModelConfig.model_validate(read_json(path)["model"])
    except (FileNotFoundError, KeyError, ValidationError, ValueError) as exc:
        raise TenantError(f"{path}: no backbone [model] of a shared deployment here ({exc})") from None


def tenant_problems(cfg: RunConfig, backbone: ModelConfig, deployment: DeploymentRecord) -> list[str]:
    """What a tenant profile must change to run on the deployment, each naming the key and the valid value."""
    problems: list[str] = []
    lora = cfg.model.lora
    if lora is None:
        problems.append(
            f"model.lora is not set: a tenant trains LoRA adapters on the shared backbone; add [model.lora] with "
            f"rank <= {deployment.max_lora_rank}"
        )
    elif lora.rank > deployment.max_lora_rank:
        problems.append(
            f"model.lora.rank = {lora.rank}: this deployment serves ranks up to shared.max_lora_rank = "
            f"{deployment.max_lora_rank}; use rank <= {deployment.max_lora_rank}"
        )
    mine = cfg.model.model_dump(mode="json", exclude={"lora"})
    theirs = backbone.model_dump(mode="json", exclude={"lora"})
    for key in sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)):
        problems.append(f"model.{key} = {mine.get(key)!r}: the deployment's backbone has {theirs.get(key)!r}")
    if cfg.inference.backend != "embedded":
        problems.append(
            f"inference.backend = {cfg.inference.backend!r}: the shared server is the embedded engine; set 'embedded'"
        )
    if cfg.trainer.parallel.world_size != 1:
        problems.append(
            f"trainer.parallel.world_size = {cfg.trainer.parallel.world_size}: the shared trainer steps a tenant "
            "in one process; set 1"
        )
    if cfg.teacher.enabled:
        problems.append(f"teacher.path = {cfg.teacher.path!r}: a tenant has no teacher; remove [teacher]")
    if cfg.weight_broadcast.type != "filesystem":
        problems.append(
            f"weight_broadcast.type = {cfg.weight_broadcast.type!r}: tenants' adapters travel through their "
            "OUTPUT_DIR; set 'filesystem'"
        )
    if cfg.shared is not None:
        problems.append("[shared] is a deployment's section (`rollflow shared up`); remove it from a tenant profile")
    return problems


def check_tenant(cfg: RunConfig, deploy_dir: str, name: str) -> SharedTarget:
    """The deployment a tenant profile attaches to, once the profile, the name and the free slots allow it."""
    deployment = read_deployment(deploy_dir)
    problems = tenant_problems(cfg, backbone_model(deploy_dir), deployment)
    if problems:
        raise TenantError(f"not a tenant profile for {deploy_dir}:\n  " + "\n  ".join(problems))
    check_slot(deploy_dir, check_tenant_name(name), cfg.output_dir, deployment)
    return SharedTarget(deploy_dir, deployment, name)


def check_slot(deploy_dir: str, name: str, output_dir: str, deployment: DeploymentRecord) -> None:
    """Refuse a name another run holds, and a deployment at max_tenants (a record of this run is its own)."""
    records, _ = read_tenants(deploy_dir)
    held = records.get(name)
    if held is not None and held.output_dir.rstrip("/") != output_dir.rstrip("/"):
        raise TenantError(
            f"tenant {name!r} is attached to {deploy_dir} by the run in {held.output_dir}; pass another --tenant "
            f"(or remove {deploy_dir}/tenants/{name}.json if that run is gone)"
        )
    others = [n for n in records if n != name]
    if len(others) >= deployment.max_tenants:
        raise TenantError(
            f"{deploy_dir} has shared.max_tenants = {deployment.max_tenants} tenants attached ({', '.join(others)}); "
            "wait for one to end"
        )


def copy_backbone(deploy_dir: str, deployment: DeploymentRecord, fs, root: str) -> bool:
    """T/weights/step=000000 as a copy of the deployment's backbone publication, every file checked against
    its manifest and the weights against deployment.backbone_sha256; False when T already has a version 0
    (which must be that backbone). T's adapter publications then name a base inside T: T stays a normal run."""
    target = weights.version_dir(root, 0)
    if is_committed(fs, target):
        have = read_manifest(fs, target).get("model_sha256")
        if have != deployment.backbone_sha256:
            raise TenantError(
                f"{target} holds model_sha256 {have}, not the backbone {deployment.backbone_sha256} of {deploy_dir}: "
                "this run was trained on another backbone"
            )
        return False
    dfs, droot = get_fs(deployment.backbone_dir)
    manifest = read_manifest(dfs, droot)
    if manifest.get("model_sha256") != deployment.backbone_sha256:
        raise TenantError(
            f"{deployment.backbone_dir}: model_sha256 {manifest.get('model_sha256')} is not the deployment's "
            f"backbone_sha256 {deployment.backbone_sha256}"
        )
    entries = manifest["files"]
    if entries.get(weights.WEIGHTS_FILE, {}).get("sha256") != deployment.backbone_sha256:
        raise TenantError(f"{deployment.backbone_dir}: not a full publication of the backbone")
    files = {name: read_file(dfs, droot, name, manifest) for name in entries}
    meta = {k: v for k, v in manifest.items() if k not in ("files", MANIFEST_CHECKSUM)}
    commit_dir(fs, target, files, meta, digests={n: e["sha256"] for n, e in entries.items()})
    return True


class Registration:
    """This run's record in D/tenants/ for one attempt; the token travels to the orchestrator by environment."""

    def __init__(self, target: SharedTarget, output_dir: str, run_id: str, weight: float = 1.0):
        self.target, self.output_dir, self.run_id, self.weight = target, output_dir, run_id, weight
        self.token = ""

    def attach(self, attempt: int, resume_step: int | None) -> int:
        """Write the record of `attempt` with a fresh token (`self.token`); returns the attempt recorded: above
        any record of this name left behind (the shared processes follow a higher attempt only), e.g. by a
        killed run that this one replaced with --overwrite."""
        self.token = secrets.token_hex(32)
        held = read_tenants(self.target.deploy_dir)[0].get(self.target.name)
        if held is not None and held.attempt >= attempt:
            attempt = held.attempt + 1
        record = TenantRecord(
            name=self.target.name,
            output_dir=self.output_dir,
            attempt=attempt,
            run_id=self.run_id,
            resume_step=resume_step,
            token_sha256=hashlib.sha256(self.token.encode()).hexdigest(),
            weight=self.weight,
        )
        write_tenant(self.target.deploy_dir, record)
        return attempt

    def detach(self) -> None:
        """Remove the record, unless another run took the name since (never remove someone else's)."""
        records, _ = read_tenants(self.target.deploy_dir)
        held = records.get(self.target.name)
        if held is not None and held.run_id == self.run_id:
            remove_tenant(self.target.deploy_dir, self.target.name)


def retire(target: SharedTarget, output_dir: str, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Before an attempt rolls the run directory back: remove the run's record left by its previous attempt and
    wait until the shared trainer let that attempt go (its summary, DEPLOY_DIR/shared_trainer.json, written after
    the poll that follows the removal, no longer names the tenant), so no step of the old attempt commits into
    the directory after the rollback; a step in progress ends first. True at once without such a record; False
    when the wait ran out or the deployment is not up (no trainer runs then)."""
    held = read_tenants(target.deploy_dir)[0].get(target.name)
    if held is None or held.output_dir.rstrip("/") != output_dir.rstrip("/"):
        return True
    remove_tenant(target.deploy_dir, target.name)
    since = time.time()
    deadline = since + timeout_s
    while time.time() < deadline:
        summary = _trainer_summary(target.deploy_dir)
        if summary.get("updated", 0) > since and target.name not in summary.get("tenants", {}):
            return True
        if (read_state(target.deploy_dir) or {}).get("state") != "up":
            return False
        time.sleep(poll_s)
    return False


def _trainer_summary(deploy_dir: str) -> dict:
    try:
        summary = read_json(join(deploy_dir, STATUS_FILE))  # the shared trainer's view of every tenant it holds
    except (FileNotFoundError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


class SharedTrainerWatch:
    """Reads T/shared_trainer.json (SharedTrainerStatus) in place of a trainer process of the run's own.

    `check()` -> True once the shared trainer finished this attempt; raises ComponentFailed when it reports
    this attempt failed, ComponentStalled when it did not report this attempt within stall.startup_s or its
    'training' report is older than stall.trainer_s. A 'waiting' report is judged the same way only with
    `judge_waiting` (every rollout step is committed, so nothing but the trainer can move): before, the tenant
    waits on its orchestrator, whose heartbeat the attempt's stall watch follows."""

    def __init__(self, fs, root: str, attempt: int, stall: StallConfig, clock: Callable[[], float] = time.time):
        self.fs, self.path, self.attempt, self.stall, self.clock = fs, join(root, STATUS_FILE), attempt, stall, clock
        self.started = clock()
        self.last: SharedTrainerStatus | None = None

    def read(self) -> SharedTrainerStatus | None:
        try:
            status = SharedTrainerStatus.model_validate_json(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValidationError, ValueError):
            return None  # absent, or mid-write on a store without atomic rename: read again next poll
        return status if status.attempt == self.attempt else None

    def check(self, judge_waiting: bool = False) -> bool:
        status = self.read()
        self.last = status or self.last
        now = self.clock()
        if status is None:
            if self.stall.enabled and now - self.started > self.stall.startup_s:
                raise ComponentStalled(
                    f"the shared trainer did not report attempt {self.attempt} in {self.path} within "
                    f"restart.stall.startup_s = {self.stall.startup_s:.0f}s; restarting the attempt"
                )
            return False
        if status.state == "failed":
            raise ComponentFailed(f"the shared trainer failed this tenant at step {status.step}: {status.error}")
        if status.state == "finished":
            return True
        judged = status.state == "training" or (judge_waiting and status.state == "waiting")
        if self.stall.enabled and judged and now - status.updated > self.stall.trainer_s:
            raise ComponentStalled(
                f"the shared trainer's last report ({status.state}, step {status.step}) is "
                f"{now - status.updated:.0f}s old "
                f"(restart.stall.trainer_s = {self.stall.trainer_s:.0f}s); restarting the attempt"
            )
        return False
