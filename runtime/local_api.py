"""A temporary local Prefect API for a CLI run that has no `PREFECT_API_URL`.

Prefect would start one by itself, as a plain subprocess that outlives a SIGKILLed parent. This one is
the same server (uvicorn on 127.0.0.1 with Prefect's app factory, UI off) started with the components'
parent-death signal, so killing the flow process cannot leave a server behind. Prefect reads
`PREFECT_API_URL` once, when it is first imported (background threads use that global value), so the
caller sets it in the environment before importing anything that imports Prefect; this module does not.
"""

from __future__ import annotations

import importlib.util
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
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None
    port = free_port("127.0.0.1")
    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", **os.environ, "PREFECT_UI_ENABLED": "0",
           "PREFECT__SERVER_EPHEMERAL": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent, start_new_session=True)  # noqa: PLW1509
    url = f"http://127.0.0.1:{port}/api"
    try:
        if while_starting is not None:
            while_starting(url)
        _wait_healthy(proc, url, timeout_s)
        yield url
    finally:
        terminate_group(proc, grace_s=5.0)
