"""Experiment tracking (MLflow)."""

from __future__ import annotations

from config.base import Strict


class TrackingConfig(Strict):
    mlflow: bool = True
    experiment: str = "rollflow"
    tracking_uri: str | None = None  # default: MLFLOW_TRACKING_URI, else sqlite in the run dir
