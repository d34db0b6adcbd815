"""Per-step metrics: `metrics.jsonl` in the run directory and, when enabled, the flow's MLflow run; for runs whose
samples carry images, a contact sheet of a few of them (storage/lake_images.py) every `tracking.image_every` steps.

metrics.jsonl is the record (written and fsync'd on the step's path). MLflow is its mirror, on a thread of its own
(`MlflowSink`): MLflow is imported there once the first step is recorded (seconds of CPU that the first step need
not wait for), and the steps' metrics are buffered (bounded) and sent every FLUSH_S in batches, so a step never
waits on the tracking store, and a store that fails or falls behind costs a warning, never the run (the row stays
in metrics.jsonl).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from config.tracking import TrackingConfig
from storage.lake_images import contact_sheet, with_images
from storage.metrics import MetricsLog, mlflow_name

log = logging.getLogger("rollflow.trainer")
FLUSH_S = 5.0  # how often the buffered metrics go to MLflow (how far behind metrics.jsonl its curves may be)
BUFFER_STEPS = 10_000  # steps waiting for the store before newer ones skip MLflow (metrics.jsonl has them)
BATCH_METRICS = 1000  # MLflow's limit of metrics per log_batch
READY_TIMEOUT_S = 120.0  # MLflow's import and the store's opening, before an image artifact gives up waiting
CLOSE_TIMEOUT_S = 60.0  # the queue's drain at the end of the process


class _HidePandas(importlib.abc.MetaPathFinder):
    """pandas reads as not installed to imports on one thread (see `_pandas_hidden_from_this_thread`)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] == "pandas" and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from MLflow's import)", name=name)
        return None


@contextlib.contextmanager
def _pandas_hidden_from_this_thread() -> Iterator[None]:
    """MLflow imports pandas at import time when it is installed (for its dataset and evaluation APIs) and does
    without it otherwise; the client calls this trainer makes (log_batch, log_image) never use it. Hidden from
    MLflow's import on the sink's thread only, it costs the trainer 48 MB and 0.7 s less (docs/benchmarks.md). A
    pandas something else imported already is used as it is; other threads import it as usual."""
    finder = _HidePandas()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class MlflowSink:
    """An MLflow client on its own thread: `log` adds a step's metrics to a bounded buffer and returns; the thread
    sends the buffer every FLUSH_S in as few `log_batch` calls as MLflow allows (a burst of Python in a second
    thread slows the step's own Python, so seldom and batched); `close` sends the rest (bounded); `client` waits
    (bounded) for the client, for the rare synchronous call (an image artifact)."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.run_id = run_id
        self._client: Any = None
        self._ready, self._closing = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._buffer: list[tuple[int, float, dict]] = []  # (step, time, values) logged before or between sends
        self._skipped = 0
        self._thread = threading.Thread(target=self._serve, args=(tracking_uri,), name="mlflow", daemon=True)

    def _start(self) -> None:
        """At the first metrics, not before: MLflow's import holds the GIL for seconds, which would slow the
        first step's own Python (the time to the first step is what a user waits for)."""
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()

    def _serve(self, tracking_uri: str) -> None:
        try:
            with _pandas_hidden_from_this_thread():
                from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri)
        except Exception as exc:  # a store that cannot open: metrics.jsonl only, said once
            log.warning(f"MLflow: cannot open the tracking store ({type(exc).__name__}: {exc}); metrics.jsonl only")
        finally:
            self._ready.set()
        while True:
            closing = self._closing.wait(FLUSH_S)
            if self._client is not None:
                self._send(self._take())
            if closing:
                return

    def _take(self) -> list[tuple[int, float, dict]]:
        with self._lock:
            rows, self._buffer = self._buffer, []
        return rows

    def _send(self, rows: list[tuple[int, float, dict]]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(mlflow_name(key), float(v), int(at * 1000), step)
            for step, at, values in rows
            for key, v in values.items()
            if isinstance(v, int | float) and key != "step" and math.isfinite(v)
        ]
        for i in range(0, len(metrics), BATCH_METRICS):
            try:
                self._client.log_batch(self.run_id, metrics=metrics[i : i + BATCH_METRICS])
            except Exception as exc:  # the store (a remote server, a full disk) must not stop training
                steps = f"steps {rows[0][0]}-{rows[-1][0]}"
                log.warning(f"MLflow: logging {steps}' metrics failed ({type(exc).__name__}: {exc}); in metrics.jsonl")
                return

    def log(self, step: int, values: dict) -> None:
        self._start()
        with self._lock:
            if len(self._buffer) < BUFFER_STEPS:
                self._buffer.append((step, time.time(), dict(values)))
                return
            self._skipped += 1
        if self._skipped == 1:
            log.warning(f"MLflow: {BUFFER_STEPS} steps behind; step {step} and later skip it (in metrics.jsonl)")

    def client(self) -> Any:
        """The client once MLflow is imported (None: it could not open the store, or took too long)."""
        self._start()
        return self._client if self._ready.wait(READY_TIMEOUT_S) else None

    def close(self) -> None:
        """Send what is buffered, waiting at most CLOSE_TIMEOUT_S (the rest is in metrics.jsonl)."""
        if self._thread.ident is None:
            return
        self._closing.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(f"MLflow: the store did not take the last metrics within {CLOSE_TIMEOUT_S:.0f} s")


class Tracker:
    """`tracking_uri`: the resolved URI (config/tracking.py's `resolve_tracking_uri`); None or no
    `mlflow_run_id`: metrics.jsonl only. `close()` when the process is done with it."""

    def __init__(self, fs, output_root: str, tracking_uri: str | None, mlflow_run_id: str | None):
        self.metrics = MetricsLog(fs, output_root)
        self.run_id = mlflow_run_id
        self.sink = MlflowSink(tracking_uri, mlflow_run_id) if tracking_uri and mlflow_run_id else None

    def record(self, row: dict) -> None:
        self.metrics.record(row)
        if self.sink is not None:
            self.sink.log(int(row["step"]), row)

    def merge(self, step: int, values: dict) -> None:
        """Add `values` to step's row (a row of its own when the step has none yet) and log only them."""
        self.metrics.record({**(self.metrics.row(step) or {"step": step}), **values})
        if self.sink is not None:
            self.sink.log(step, values)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

    def log_samples(self, step: int, table, cfg: TrackingConfig) -> str | None:
        """The first `cfg.image_samples` samples with images of step `step`'s rollouts (Arrow table), as one PNG
        artifact `samples/step=NNNNNN.png`, every `cfg.image_every` steps; its artifact path, or None (not this
        step, no MLflow, no images). Best effort: a failure to log is a warning, never the run's end."""
        if self.sink is None or cfg.image_samples == 0 or step % cfg.image_every:
            return None
        sheet = contact_sheet(with_images(table, cfg.image_samples), columns=cfg.image_samples)
        if sheet is None:
            return None
        path = f"samples/step={step:06d}.png"
        client = self.sink.client()
        if client is None:
            return None
        try:
            client.log_image(self.run_id, sheet, artifact_file=path)
        except Exception as exc:  # the tracking store (a remote server, a full disk) must not stop training
            log.warning(f"MLflow: logging {path} failed: {type(exc).__name__}: {exc}")
            return None
        return path
