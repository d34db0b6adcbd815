"""The tenant contract of a shared deployment (docs/multitenant.md): what a tenant run registers and what the
shared inference server and shared trainer read.

A shared deployment is a directory DEPLOY_DIR holding `deployment.json` (`DeploymentRecord`: the backbone every
tenant adapts and where the shared processes listen) and `tenants/<name>.json`, one `TenantRecord` per tenant run
attached to it. A tenant's flow writes its record (atomically) when an attempt starts and removes it when the run
ends; the shared inference server and the shared trainer poll `tenants/` and follow it: a new name joins, a
removed one leaves, a higher `attempt` of the same name (a resume) drops what they held for the older one and
starts again from the tenant's checkpoint. Secrets never appear here: the tenant's token travels by environment
variable, the record holds its SHA-256 only.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from config.base import Strict

TENANT_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")  # a file name, a model name and a metrics label alike
TENANT_TOKEN_ENV = "ROLLFLOW_TENANT_TOKEN"  # the tenant's bearer token for its requests to the shared server
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def check_tenant_name(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.match(name):
        raise ValueError(
            f"tenant name {name!r} is not valid: 1-32 characters, a lowercase letter first, then lowercase letters, "
            "digits or '-'"
        )
    return name


class TenantRecord(Strict):
    """`DEPLOY_DIR/tenants/<name>.json`: one tenant run attached to the deployment."""

    name: str = Field(description="the tenant's name: its file name, its served model name, its label in metrics")
    output_dir: str = Field(
        description="the tenant run's OUTPUT_DIR (local path or URL): its own lake, weights, "
        "checkpoints, metrics and `config/trainer.json`"
    )
    attempt: int = Field(ge=0, description="bumped by each attempt of the tenant's run; processes drop older ones")
    run_id: str = Field(min_length=1, max_length=128)
    resume_step: int | None = Field(None, ge=0, description="the checkpoint this attempt starts from, None: version 0")
    token_sha256: str = Field(description="SHA-256 (hex) of the tenant's bearer token (TENANT_TOKEN_ENV)")
    weight: float = Field(
        1.0, gt=0, le=100, description="the tenant's share of the shared trainer (weighted round robin)"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_tenant_name(v)

    @field_validator("token_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not SHA256_RE.match(v):
            raise ValueError("token_sha256 must be 64 lowercase hex digits (the SHA-256 of the tenant's token)")
        return v


class DeploymentRecord(Strict):
    """`DEPLOY_DIR/deployment.json`: written once by the shared deployment when it starts."""

    backbone_dir: str = Field(
        description="the backbone publication every tenant's adapters apply to (DEPLOY_DIR/weights/step=000000)"
    )
    backbone_sha256: str = Field(description="its manifest's model_sha256: a tenant whose version 0 differs is refused")
    inference_url: str = Field(description="the shared inference server's base URL")
    max_tenants: int = Field(ge=1, le=64)
    max_lora_rank: int = Field(ge=1, le=256)


class SharedConfig(Strict):
    """`[shared]` of a deployment's profile (`rollflow shared up @ profile --deploy-dir D`): the profile's [model] is
    the backbone (its warm-up publishes it), its [inference] and [trainer] size the shared processes."""

    max_tenants: int = Field(4, ge=1, le=64, description="tenants attached at once; one more is refused at join")
    max_lora_rank: int = Field(16, ge=1, le=256, description="the largest [model.lora] rank a tenant may use")
    poll_s: float = Field(0.5, gt=0, le=30, description="how often the shared processes re-read DEPLOY_DIR/tenants/")


class SharedInferenceSettings(Strict):
    """What the shared inference server adds to its InferenceProcessConfig: where the tenant records are."""

    deploy_dir: str
    shared: SharedConfig


class SharedTrainerStatus(Strict):
    """`<tenant OUTPUT_DIR>/shared_trainer.json`, written (atomically) by the shared trainer for each tenant after
    every change: the tenant's flow reads it in place of a trainer process of its own (progress, end, failure)."""

    attempt: int = Field(ge=0, description="the tenant record's attempt this status belongs to")
    state: str = Field(description="'waiting' (for rollouts), 'training', 'finished' (max_steps done), or 'failed'")
    step: int = Field(ge=0, description="the last step trained and published (0: none yet)")
    error: str | None = None
    updated: float = Field(description="unix time of this write: the tenant flow's stall watch reads it")
    trainer_s: float = Field(0.0, ge=0, description="seconds of shared-trainer time this tenant's steps took")
