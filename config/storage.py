"""Storage settings (non-secret; credentials come from the environment)."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from config.base import Strict

# Option names that carry credentials; these travel by environment (AWS_ACCESS_KEY_ID, ...), never config.
SECRET_OPTION = re.compile(r"(secret|token|password|passwd|credential|(^|_)key($|_)|access_key|session)", re.I)


class StorageConfig(Strict):
    """Non-secret storage settings (docs/storage.md). Credentials come from the AWS environment variables
    or profiles that botocore reads; `AWS_ENDPOINT_URL` works as well as `endpoint_url`."""

    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    region: str | None = None
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="extra fsspec/s3fs keyword arguments that are not secret"
    )
    timeout_s: float = Field(30.0, gt=0, description="connect and read timeout of one storage request")
    retry_budget_s: float = Field(120.0, ge=0, description="how long one operation may keep retrying")
    retry_max_attempts: int = Field(12, ge=1)
    retry_base_s: float = Field(0.2, gt=0, description="first backoff; doubles per attempt, full jitter")
    retry_max_backoff_s: float = Field(10.0, gt=0)
    keep_last_weights: int | None = Field(None, ge=1, description="None keeps every weight publication")
    keep_every_weights: int | None = Field(None, ge=1, description="also keep publications at multiples of K")
    keep_last_checkpoints: int | None = Field(None, ge=1, description="None keeps every checkpoint")
    keep_every_checkpoints: int | None = Field(None, ge=1, description="also keep checkpoints at multiples of K")
    weights_delta: bool = Field(False, description="publish weights as a diff against the previous version")
    weights_full_every: int = Field(10, ge=1, description="with weights_delta: a full publication every N")
    fsync: bool = Field(
        True, description="local disk: fsync each file before its rename, its folder after (power-loss safety)"
    )

    @model_validator(mode="after")
    def _no_secrets(self) -> StorageConfig:
        secret = sorted(k for k in self.options if SECRET_OPTION.search(k))
        if secret:
            raise ValueError(
                f"storage.options.{secret[0]}: credentials are not accepted in config files or flags (they would "
                "be stored in config/run.json and MLflow); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
                "AWS_SESSION_TOKEN or AWS_PROFILE in the environment instead"
            )
        for kind in ("weights", "checkpoints"):
            if getattr(self, f"keep_every_{kind}") is not None and getattr(self, f"keep_last_{kind}") is None:
                raise ValueError(
                    f"storage.keep_every_{kind} only applies together with storage.keep_last_{kind} "
                    f"(without it every {kind} entry is kept anyway); set storage.keep_last_{kind}"
                )
        if self.endpoint_url and "@" in self.endpoint_url.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "storage.endpoint_url must not carry user:password@; set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY in the environment instead"
            )
        return self
