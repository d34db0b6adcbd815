"""Helpers of the multi-tenant integration tests (test_multitenant*.py): a real shared deployment started with
`rollflow shared up` (the backbone's warm-up, then the shared inference server and trainer), tenant runs started
with the real CLI, the checks every finished tenant run must pass, and `rollflow shared down`.

    shared_deployment(tmp_path, api, *args) -> Deployment (up; its record read) -> tests start tenants on it
    -> shut_down(dep) in the test (asserted) -> on leaving, anything still running is killed and must be gone
and the tools to follow and hurt tenants: step_times (metrics.jsonl rows), wait_until (bounded, while named runs
must stay alive), kill_tree (SIGKILL a tenant run's whole process group, as a crash would).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import ROOT, cli_argv, cli_env, descendants, processes_mentioning, start_cli
from test_resume import _assert_nothing_lost_or_duplicated, _wait_gone

from storage.fs import get_fs, read_manifest

BASE = [ROOT / "profiles" / "tiny-cpu.toml", ROOT / "profiles" / "tiny-cpu-shared.toml"]
SHORT = ROOT / "tests" / "profiles" / "shared-short.toml"
TENANT = [ROOT / "profiles" / "tiny-cpu-lora.toml", ROOT / "tests" / "profiles" / "tenant-short.toml"]


def profile_args(profiles: list[Path]) -> list[str]:
    return [t for p in profiles for t in ("@", str(p))]


def write_profile(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@dataclass
class Deployment:
    dir: Path
    logs: Path
    api: str
    up: subprocess.Popen
    record: dict = field(default_factory=dict)
    up_s: float = 0.0

    def tenant(self, name: str, profiles: list[Path], *args: str) -> subprocess.Popen:
        """`rollflow rl @ profiles --tenant-of D --tenant NAME --output-dir <tmp>/NAME` in a session of its own."""
        argv = ["rl", *profile_args(profiles), "--output-dir", str(self.dir.parent / name), *args]
        argv += ["--tenant-of", str(self.dir), "--tenant", name]
        return start_cli(self.dir.parent, self.log(name), self.api, *argv)

    def resume(self, name: str) -> subprocess.Popen:
        """`rollflow resume T --tenant-of D --tenant NAME`: the real CLI's resume onto this deployment."""
        out = str(self.dir.parent / name)
        return start_cli(self.dir.parent, self.log(name), self.api, "resume", out, "--tenant-of", str(self.dir),
                         "--tenant", name)  # fmt: skip

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def tail(self, name: str) -> str:
        return self.log(name).read_text()[-4000:]


def wait_up(deploy: Path, cli: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> dict:
    """Until the deployment says up (the warm-up published the backbone, both processes launched)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert cli.poll() is None, log.read_text()[-4000:]
        try:
            state = json.loads((deploy / "shared_state.json").read_text())
        except (FileNotFoundError, ValueError):
            state = {}
        if state.get("state") == "up":
            return state
        time.sleep(0.5)
    raise AssertionError(f"the deployment was not up in {timeout_s}s:\n" + log.read_text()[-4000:])


@contextmanager
def shared_deployment(tmp_path: Path, api: str, *args: str) -> Iterator[Deployment]:
    """`rollflow shared up @ tiny-cpu @ tiny-cpu-shared @ shared-short --deploy-dir <tmp>/shared ARGS`, up."""
    deploy, logs = tmp_path / "shared", tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.monotonic()
    argv = ["shared", "up", *profile_args([*BASE, SHORT]), "--deploy-dir", str(deploy), *args]
    dep = Deployment(deploy, logs, api, start_cli(tmp_path, logs / "up.log", api, *argv))
    try:
        wait_up(deploy, dep.up, logs / "up.log")
        dep.up_s = time.monotonic() - t0
        dep.record = json.loads((deploy / "deployment.json").read_text())
        yield dep
    finally:
        if dep.up.poll() is None:
            dep.up.kill()
            dep.up.wait()
        deadline = time.monotonic() + 30
        while processes_mentioning(str(deploy)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(deploy)) == [], "the shared processes outlived `shared down`"


@contextmanager
def tenant_runs(dep: Deployment) -> Iterator[dict[str, subprocess.Popen]]:
    """The tenant runs a test starts in the block (name -> CLI process); `finish()` waits for each to exit 0. Any
    still running when the block ends (a failed assertion) is killed."""
    runs: dict[str, subprocess.Popen] = {}
    try:
        yield runs
    finally:
        for cli in runs.values():
            if cli.poll() is None:
                cli.kill()
                cli.wait()


def finish(dep: Deployment, runs: dict[str, subprocess.Popen], timeout_s: float = 600) -> None:
    """Every run exits 0 within `timeout_s` (its log's tail otherwise)."""
    for name, cli in runs.items():
        assert cli.wait(timeout=timeout_s) == 0, dep.tail(name)


def shut_down(dep: Deployment) -> None:
    """`rollflow shared down D`: it says down and `shared up` exits 0."""
    down = subprocess.run(
        cli_argv("shared", "down", str(dep.dir)), env=cli_env(dep.api), capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0 and json.loads(down.stdout)["state"] == "down", down.stdout + down.stderr
    assert dep.up.wait(timeout=60) == 0, (dep.logs / "up.log").read_text()[-4000:]


def check_tenant(out: Path, backbone_sha: str, max_steps: int, snapshots: dict[int, str] | None = None) -> None:
    """A finished tenant run: the resume audit passes, version 0 is the backbone's checked copy inside the run
    directory, the last publication an adapter on it, and the shared trainer reported the run finished."""
    _assert_nothing_lost_or_duplicated(out, max_steps, snapshots or {})
    assert json.loads((out / "state.json").read_text())["status"] == "finished"
    fs, root = get_fs(str(out))
    version0 = read_manifest(fs, f"{root}/weights/step=000000")
    assert version0["model_sha256"] == backbone_sha  # the backbone's checked copy
    last = read_manifest(fs, f"{root}/weights/step={max_steps:06d}")
    assert last["encoding"] == "lora" and last["lora_base"]["model_sha256"] == backbone_sha
    assert last["lora_base"]["path"] == "weights/step=000000"  # a base inside the tenant's own directory
    status = json.loads((out / "shared_trainer.json").read_text())
    assert status["state"] == "finished" and status["step"] == max_steps and status["trainer_s"] > 0


def step_times(out: Path) -> list[tuple[int, float]]:
    """(step, time) of every metrics.jsonl row, in file order (a row cut short by a kill is skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
            rows.append((int(row["step"]), float(row["time"])))
        except (ValueError, KeyError, TypeError):
            continue
    return rows


def wait_until(what: str, cond: Callable[[], bool], alive: dict[str, subprocess.Popen], dep: Deployment,
                timeout_s: float = 300.0) -> None:  # fmt: skip
    """Until `cond()`, every run in `alive` still running throughout."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        for name, cli in alive.items():
            assert cli.poll() is None, f"{name} ended while waiting for {what}:\n{dep.tail(name)}"
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.2)


def kill_tree(cli: subprocess.Popen, out: Path) -> None:
    """SIGKILL the tenant run's whole process group (flow, orchestrator, its local helpers), as a crash would."""
    victims = [cli.pid, *descendants(cli.pid)]
    os.killpg(cli.pid, signal.SIGKILL)
    for pid in victims:  # anything that left the group
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cli.wait()
    _wait_gone(out)
