"""Per-step metrics: `metrics.jsonl` in the run directory and, when enabled, the flow's MLflow run; for runs whose
samples carry images, a contact sheet of a few of them (storage/lake_images.py) every `tracking.image_every` steps."""

from __future__ import annotations

import logging
import math
import time

from config.tracking import TrackingConfig
from storage.lake_images import contact_sheet, with_images
from storage.metrics import MetricsLog, mlflow_name

log = logging.getLogger("rollflow.trainer")


class Tracker:
    """`tracking_uri`: the resolved URI (config/tracking.py's `resolve_tracking_uri`); None or no
    `mlflow_run_id`: metrics.jsonl only."""

    def __init__(self, fs, output_root: str, tracking_uri: str | None, mlflow_run_id: str | None):
        self.metrics = MetricsLog(fs, output_root)
        self.client = None
        self.run_id = mlflow_run_id
        if tracking_uri and mlflow_run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri)

    def record(self, row: dict) -> None:
        self.metrics.record(row)
        self._log(int(row["step"]), row)

    def merge(self, step: int, values: dict) -> None:
        """Add `values` to step's row (a row of its own when the step has none yet) and log only them."""
        self.metrics.record({**(self.metrics.row(step) or {"step": step}), **values})
        self._log(step, values)

    def _log(self, step: int, values: dict) -> None:
        if self.client is None or self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(mlflow_name(key), float(v), now, step)
            for key, v in values.items()
            if isinstance(v, int | float) and key != "step" and math.isfinite(v)
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, table, cfg: TrackingConfig) -> str | None:
        """The first `cfg.image_samples` samples with images of step `step`'s rollouts (Arrow table), as one PNG
        artifact `samples/step=NNNNNN.png`, every `cfg.image_every` steps; its artifact path, or None (not this
        step, no MLflow, no images). Best effort: a failure to log is a warning, never the run's end."""
        if self.client is None or self.run_id is None or cfg.image_samples == 0 or step % cfg.image_every:
            return None
        sheet = contact_sheet(with_images(table, cfg.image_samples), columns=cfg.image_samples)
        if sheet is None:
            return None
        path = f"samples/step={step:06d}.png"
        try:
            self.client.log_image(self.run_id, sheet, artifact_file=path)
        except Exception as exc:  # the tracking store (a remote server, a full disk) must not stop training
            log.warning(f"MLflow: logging {path} failed: {type(exc).__name__}: {exc}")
            return None
        return path
