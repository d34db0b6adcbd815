"""The app the CLI's temporary local Prefect API serves (runtime/local_api.py runs it under uvicorn; it lives in
flows/, where Prefect is imported): Prefect's own app factory, with its background task worker checking for due
work every `CHECK_S` seconds instead of every 0.25 s.

That worker (docket, over an in-memory queue in this one process) runs the server's periodic services, none of
which a single run's temporary API needs sooner than within seconds; polling four times a second was a third of
the idle server's CPU (0.0155 CPU-seconds per second against 0.0105 at 2 s, on an idle 2-core machine), taken
from the run's steps.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

CHECK_S = 2.0


def create_app() -> Any:
    """Prefect's `create_app`, its background worker polling every CHECK_S."""
    from docket import Worker
    from prefect.server.api import background_workers
    from prefect.server.api.server import create_app as prefect_create_app

    class CalmerWorker(Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("minimum_check_interval", timedelta(seconds=CHECK_S))
            kwargs.setdefault("scheduling_resolution", timedelta(seconds=CHECK_S))
            super().__init__(*args, **kwargs)

    background_workers.Worker = CalmerWorker  # type: ignore[misc]  # the name background_worker() builds it from
    return prefect_create_app()
