"""A local OpenEnv server as a child process of rollflow's orchestrator: start, wait for health, stop.

`OpenEnvServer(name, app, ...)` serves an OpenEnv app (an ASGI app made by openenv-core's `create_app`, named
`module:attribute`, e.g. `my_env.server.app:app`) with `python -m uvicorn` on a socket rollflow binds itself
on 127.0.0.1 (a free port, handed to uvicorn by file descriptor, so no other process can take the port
between choosing and binding it, and nothing listens beyond loopback). `start()` returns once `GET /health`
answers 200, within `startup_timeout_s`; the child's output goes to a log file whose path and last lines every
failure names. `stop()` terminates it (SIGTERM, then SIGKILL after a bound); the kernel also sends SIGTERM
if the orchestrator dies without stopping it (PR_SET_PDEATHSIG). The web UI (gradio) stays off.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engines.registry import PluginError

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0
POLL_S = 0.2
LOG_TAIL_LINES = 20


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux/glibc: stop() still runs on every orderly exit


# Resolved in the parent: the child between fork and exec must not load libraries.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


class OpenEnvServer:
    """One OpenEnv server process for environment `name` (see the module docstring)."""

    def __init__(self, name: str, app: str, startup_timeout_s: float, log_dir: str | None = None):
        self.name, self.app, self.startup_timeout_s, self.log_dir = name, app, startup_timeout_s, log_dir
        self.log = Path(os.devnull)
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # of the last process started (the log's name carries the orchestrator's)
        self.url = ""

    def _log_path(self) -> Path:
        """`log_dir`, or a new private temporary folder (mode 0700), / openenv-<name>-<pid>.log."""
        folder = Path(self.log_dir) if self.log_dir else Path(tempfile.mkdtemp(prefix="rollflow-openenv-"))
        folder.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        return folder / f"openenv-{safe}-{os.getpid()}.log"

    def _spawn(self) -> None:
        self.log = self._log_path()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((HOST, 0))
            sock.listen(128)
            port, fd = sock.getsockname()[1], sock.fileno()
            argv = [sys.executable, "-m", "uvicorn", self.app, "--fd", str(fd), "--log-level", "warning"]
            env = {**os.environ, "ENABLE_WEB_INTERFACE": "false"}  # openenv's gradio UI: not needed, not installed
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=(fd,), preexec_fn=_die_with_parent
                )
        finally:
            sock.close()  # the child holds its own copy of the listening socket
        self.pid = self.proc.pid
        self.url = f"http://{HOST}:{port}"

    def _failure(self, what: str) -> PluginError:
        return PluginError(
            f"OpenEnv environment {self.name!r}: the server for app {self.app!r} (pid {self.pid}) {what}; "
            f"its log {self.log} ends:\n" + log_tail(self.log)
        )

    async def start(self) -> str:
        """The server's base URL once it is healthy; PluginError naming the env and its log otherwise."""
        self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(base_url=self.url, timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                code = self.proc.poll()
                if code is not None:
                    self.proc, self.url = None, ""  # reaped; a later start() starts anew
                    raise self._failure(f"exited with code {code} before it was healthy")
                try:
                    if (await client.get("/health")).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass  # still importing: the socket queues the connection, the request times out
                await asyncio.sleep(POLL_S)
        self.stop()
        raise self._failure(f"was not healthy within startup_timeout_s = {self.startup_timeout_s:g} s (stopped)")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after STOP_GRACE_S); a later start() starts a new one."""
        proc, self.proc, self.url = self.proc, None, ""
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
