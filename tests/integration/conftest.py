"""Shared pieces of the integration tests: a real Prefect API, and launching the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "profiles" / "tiny-cpu.toml"


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (the test harness's server) that CLI subprocesses report to."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # a loaded 2-core machine can take > 30 s
        yield PREFECT_API_URL.value()


def cli_env(api_url: str | None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollflow.cli", *args]


def start_cli(cwd: Path, log: Path, api_url: str | None, *args: str) -> subprocess.Popen:
    """The CLI in a session of its own, so a test can kill its whole tree."""
    with open(log, "ab") as f:
        return subprocess.Popen(
            cli_argv(*args), cwd=cwd, env=cli_env(api_url), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def component_pid(cli_pid: int, name: str) -> int | None:
    """The pid of the trainer, orchestrator or inference server under the CLI process `cli_pid`, if running."""
    configs = {"trainer": ("trainer.json", "sft.json"), "orchestrator": ("orchestrator.json",),
               "inference": ("inference.json",)}[name]  # fmt: skip
    for config in configs:  # before the RL trainer starts, the warm-up is the trainer
        for pid in descendants(cli_pid):
            try:
                if f"config/{config}" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    return pid
            except OSError:
                continue
    return None


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes that mention `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(cmdline.replace("\0", " "))
    return found


def prefect_cli(api: str, *args: str, timeout: float = 180) -> str:
    """Run the `prefect` CLI of this venv against `api`; fails the test with its output on a non-zero exit."""
    env = {**cli_env(api), "ROLLFLOW_HOME": str(ROOT)}
    prefect = str(Path(sys.executable).parent / "prefect")
    proc = subprocess.run([prefect, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (1s) in a completion mask."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
