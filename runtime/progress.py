"""Where a running run is, for the live view in the Prefect UI (flows/progress.py publishes it).

flow process: MetricsWatcher thread, every `interval_s` and once more when the run stops
  read()    -> the metrics rows, or None when unchanged (storage/metrics.py MetricsFollower)
  publish() <- the rows; flows/progress.py turns them into `progress_view` and updates its artifacts
A failed read or publish is logged (once per distinct message in a row) and the next poll tries again: the
view is best effort and never ends the run. `progress_view` is pure: given the rows, what to show.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from runtime.curves import run_curves, sparkline_block

POLL_S = 5.0
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProgressView:
    step: int  # the latest step with the training curve's value; 0 before the first
    max_steps: int
    percent: float  # step / max_steps, in 0..100
    markdown: str


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def progress_view(rows: list[dict], max_steps: int, key: str = "reward_mean") -> ProgressView:
    """The latest step of `key` out of `max_steps`, and a markdown table of the latest value of `key` and of
    every held-out evaluation curve (each with the step it is from), followed by their sparklines."""
    curves = run_curves(rows, key)
    step = curves[key][-1][0] if key in curves else 0
    percent = min(100.0, max(0.0, 100.0 * step / max_steps)) if max_steps > 0 else 0.0
    lines = [f"### step {step} / {max_steps} ({percent:.0f}%)", ""]
    if curves:
        lines += ["| metric | step | latest |", "|---|---|---|"]
        lines += [f"| {name} | {c[-1][0]} | {_fmt(c[-1][1])} |" for name, c in curves.items()]
        lines += ["", sparkline_block(curves)]
    else:
        lines.append("waiting for the first step")
    return ProgressView(step, max_steps, percent, "\n".join(lines))


class MetricsWatcher:
    """Calls `publish(rows)` from a daemon thread whenever `read()` returns rows (None: unchanged), polling
    every `interval_s` from start until the context exits, then once more. Exiting waits for the thread at
    most `join_timeout_s`."""

    def __init__(
        self,
        read: Callable[[], list[dict] | None],
        publish: Callable[[list[dict]], None],
        logger,
        interval_s: float = POLL_S,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ):
        self.read, self.publish, self.logger = read, publish, logger
        self.interval_s, self.join_timeout_s = interval_s, join_timeout_s
        self.polls = self.published = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watcher", daemon=True)
        self._last_error = ""
        self._pending: list[dict] | None = None  # rows read but not yet published (a failed publish retries)

    def __enter__(self) -> MetricsWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.join_timeout_s)
        if self._thread.is_alive():
            self.logger.warning(f"progress view: its last update took over {self.join_timeout_s:.0f}s; left behind")

    def _run(self) -> None:
        self.poll()
        while not self._stop.wait(self.interval_s):
            self.poll()
        self.poll()  # the state the run stopped in

    def poll(self) -> None:
        self.polls += 1
        try:
            rows = self.read()
            if rows is not None:
                self._pending = rows
            if self._pending is not None:
                self.publish(self._pending)
                self._pending = None
                self.published += 1
            self._last_error = ""
        except Exception as exc:  # noqa: BLE001 - the view is best effort: a failure is reported, never raised
            message = f"{type(exc).__name__}: {exc}"
            if message != self._last_error:
                self.logger.warning(f"progress view: update failed ({message}); retrying every {self.interval_s}s")
            self._last_error = message
