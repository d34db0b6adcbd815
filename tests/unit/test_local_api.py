"""runtime/local_api.py: the CLI's temporary Prefect API, and the progress view's pace against it."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from flows.progress import TEMPORARY_API_POLL_S, poll_interval
from runtime.local_api import LOCAL_API_ENV, QUIET_SERVICES, local_prefect_api
from runtime.progress import POLL_S


def test_the_temporary_api_serves_marks_itself_and_unmarks_itself_when_it_stops(monkeypatch):
    # PREFECT_HOME as a CLI run has it: a fresh home would add its database's migrations (~20 s here)
    monkeypatch.delenv(LOCAL_API_ENV, raising=False)
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "on")  # the caller's setting wins
    with local_prefect_api(timeout_s=120) as url:
        assert url.startswith("http://127.0.0.1:") and os.environ[LOCAL_API_ENV] == url
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert json.loads(r.read()) is True
        env = _server_environment(url)
        assert {k: env[k] for k in QUIET_SERVICES} == QUIET_SERVICES | {
            "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "on"
        }
        assert env["PREFECT_UI_ENABLED"] == "0"
    assert LOCAL_API_ENV not in os.environ


def _server_environment(url: str) -> dict[str, str]:
    """The environment of the uvicorn process serving `url` (a child of this process)."""
    port = url.split(":")[2].split("/")[0]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"uvicorn" in cmd and port.encode() in cmd:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)
        except OSError:
            continue
    raise AssertionError(f"no uvicorn process serves {url}")


def test_the_progress_view_slows_down_only_against_the_temporary_api(monkeypatch):
    monkeypatch.setenv(LOCAL_API_ENV, "http://127.0.0.1:4200/api")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert poll_interval() == TEMPORARY_API_POLL_S > POLL_S
    monkeypatch.setenv("PREFECT_API_URL", "http://prefect.example:4200/api")  # a server the user runs
    assert poll_interval() == POLL_S
    monkeypatch.delenv(LOCAL_API_ENV)
    assert poll_interval() == POLL_S
