"""A temporary local Prefect API for a CLI run that has no `PREFECT_API_URL`.

Prefect would start one by itself, as a plain subprocess that outlives a SIGKILLed parent. This one is the same
server (uvicorn on 127.0.0.1 with Prefect's app factory, UI off) started with the components' parent-death signal,
so killing the flow process cannot leave a server behind. It serves one run and nobody else: its background worker
polls less often (flows/local_api_app.py), services a one-run server has no use for are off (`QUIET_SERVICES`), and
while it serves, `LOCAL_API_ENV` holds its URL (the progress view slows down against it: flows/progress.py).
Prefect reads `PREFECT_API_URL` once, when it is first imported (background threads use that global value), so the
caller sets it in the environment before importing anything that imports Prefect; this module does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.process import die_with_parent, terminate_group
from runtime.rundir import free_port

LOCAL_API_ENV = "ROLLFLOW_LOCAL_PREFECT_API"  # the temporary API's URL while it serves (flows/progress.py reads it)
# Services a temporary API serving one run has no use for, off unless the environment says otherwise: the event
# vacuum (a long-lived server's retention chore) and automation triggers (automations belong on a server that
# outlives the command). Measured with the worker's slower polling (flows/local_api_app.py) and the progress
# view's pace (flows/progress.py): docs/benchmarks.md, "Third pass".
QUIET_SERVICES = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
}


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the local Prefect API exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the local Prefect API at {url} was not healthy after {timeout_s:.0f}s")


@contextmanager
def local_prefect_api(timeout_s: float = 60.0, while_starting: Callable[[str], object] | None = None) -> Iterator[str]:
    """Serve a Prefect API on a free loopback port for the duration; yields its URL once it answers.
    `while_starting(url)` runs while the server boots (seconds of imports in its own process), so the caller's
    own start-up (setting PREFECT_API_URL, importing Prefect and the flow) overlaps it instead of following it."""
    port = free_port("127.0.0.1")
    env = {**QUIET_SERVICES, **os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"}
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(__file__).resolve().parent.parent),
            "--factory", "flows.local_api_app:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent, start_new_session=True)  # noqa: PLW1509
    url = f"http://127.0.0.1:{port}/api"
    os.environ[LOCAL_API_ENV] = url
    try:
        if while_starting is not None:
            while_starting(url)
        _wait_healthy(proc, url, timeout_s)
        yield url
    finally:
        os.environ.pop(LOCAL_API_ENV, None)
        terminate_group(proc, grace_s=5.0)
