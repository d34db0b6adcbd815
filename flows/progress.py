"""The live view of an `rl` run in the Prefect UI: a progress artifact (`rl-progress`: trained steps out of
`max_steps`, in percent) and a markdown artifact (`rl-run-status`: the latest step, reward and held-out
evaluation scores, with sparklines), both updated in place while the run runs.

flow (this thread): create both artifacts (bound to the flow run by Prefect's context), open an API client
watcher thread (runtime/progress.py): every POLL_S s, metrics.jsonl if changed (local or object storage)
  -> progress_view -> update both artifacts by id; a last update when the attempts end
Failures to create or update are logged and the run goes on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from runtime.local_api import LOCAL_API_ENV
from runtime.progress import POLL_S, MetricsWatcher, ProgressView, progress_view
from storage.metrics import MetricsFollower

TEMPORARY_API_POLL_S = 60.0
PROGRESS_KEY = "rl-progress"
STATUS_KEY = "rl-run-status"


@contextmanager
def live_progress(
    fs, root: str, max_steps: int, run_id: str, logger, interval_s: float | None = None
) -> Iterator[None]:
    """Keep the run's progress artifacts current for the duration of the block, every `interval_s` (default
    `poll_interval()`)."""
    interval_s = poll_interval() if interval_s is None else interval_s
    publish = _publisher(max_steps, run_id, logger)
    if publish is None:
        yield
        return
    client, update, shown = publish
    with client, MetricsWatcher(MetricsFollower(fs, root).poll, update, logger, interval_s) as watcher:
        yield
    last = f"; the last at step {shown[-1].step} / {max_steps}" if shown else ""
    logger.info(f"live progress: {watcher.published} update(s) of {PROGRESS_KEY} and {STATUS_KEY}{last}")


def poll_interval() -> float:
    """POLL_S; TEMPORARY_API_POLL_S against the CLI's temporary local API (runtime/local_api.py), which serves no
    UI, so nobody sees the view until the run has ended (the last update is made then). Each update is two
    artifact writes and their events: 170 of the 285 events the temporary API stored over six short runs."""
    url = os.environ.get("PREFECT_API_URL")
    return TEMPORARY_API_POLL_S if url and url == os.environ.get(LOCAL_API_ENV) else POLL_S


def _publisher(max_steps: int, run_id: str, logger):
    """Create both artifacts in the flow's context -> (API client, rows -> update both, the last view shown);
    None when the API refuses (the run goes on without the view)."""
    try:
        start = progress_view([], max_steps)
        # called from a sync flow, these return the id (the coroutine half of their type is for async callers)
        progress_id = cast(UUID, create_progress_artifact(start.percent, key=PROGRESS_KEY, description=f"run {run_id}"))
        status_id = cast(UUID, create_markdown_artifact(start.markdown, key=STATUS_KEY, description=f"run {run_id}"))
        client = get_client(sync_client=True)  # made here: a thread does not see the flow's settings context
    except Exception as exc:  # noqa: BLE001 - the view is best effort
        logger.warning(f"progress view: could not create its artifacts ({type(exc).__name__}: {exc}); running without")
        return None

    shown: list[ProgressView] = []  # the last view published, for the closing log line

    def update(rows: list[dict]) -> None:
        view = progress_view(rows, max_steps)
        client.update_artifact(progress_id, ArtifactUpdate(data=view.percent))
        client.update_artifact(status_id, ArtifactUpdate(data=view.markdown))
        shown[:] = [view]

    return client, update, shown
