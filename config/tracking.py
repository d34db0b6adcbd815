"""Experiment tracking (MLflow): the settings, and the one rule for which tracking URI a process uses."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from config.base import Strict
from config.redact import is_redacted, redact_url

ENV_VAR = "MLFLOW_TRACKING_URI"


class TrackingConfig(Strict):
    mlflow: bool = True
    experiment: str = "rollflow"
    tracking_uri: str | None = None  # default: MLFLOW_TRACKING_URI, else sqlite in the run dir
    # samples with images logged to MLflow as one contact-sheet PNG, every `image_every` trainer steps (0: never)
    image_samples: int = Field(2, ge=0, le=16)
    image_every: int = Field(10, ge=1)


def resolve_tracking_uri(
    configured: str | None, output_dir: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """The MLflow tracking URI: `tracking.tracking_uri` when set, else MLFLOW_TRACKING_URI, else a sqlite store
    in a local run directory (None for an object-store run directory: no MLflow).

    The flow and the trainer both call this. Credentials travel by environment only: the trainer's config holds
    the URI with its credentials redacted (`https://***@host`), and MLFLOW_TRACKING_URI the same URI in full,
    which is then the one used."""
    env = (os.environ if environ is None else environ).get(ENV_VAR) or None
    if configured and env and redact_url(env) == configured:
        return env
    if configured and is_redacted(configured):
        raise ValueError(
            f"tracking.tracking_uri={configured!r} has its credentials redacted and {ENV_VAR} "
            f"{'is not set' if env is None else 'holds another URI'}: give the full URI in {ENV_VAR}"
        )
    uri = configured or env
    if uri:
        return uri
    if "://" in output_dir and not output_dir.startswith("file://"):
        return None
    path = Path(output_dir.removeprefix("file://")).resolve() / "mlflow.db"
    return f"sqlite:///{path}"


def refuse_credentials_in_config(configured: str | None) -> None:
    """A flow's config (its Prefect parameters) must not carry the tracking URI's credentials: Prefect stores and
    shows them, run.json keeps the URI redacted, and a resume (`rollflow resume`, the scheduled resume flow)
    could not recover them. The CLI moves such a URI to MLFLOW_TRACKING_URI before it starts the flow; a
    deployment's worker needs it in its own environment."""
    if configured and redact_url(configured) != configured:
        raise ValueError(
            f"tracking.tracking_uri={redact_url(configured)!r} carries credentials in the flow's parameters: set "
            f"{ENV_VAR} (or MLflow's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) in the environment of the "
            "process that runs the flow (a Prefect worker's) and leave tracking.tracking_uri unset or credential-free"
        )
