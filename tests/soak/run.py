"""One `rollflow rl` under the soak: starts it, resumes it, finds its processes, reads its progress.

The CLI runs in a session of its own (tests/integration/conftest.py start_cli), so a fault can kill its whole tree;
every resume replaces `cli`. Progress is read from the run's metrics.jsonl through fsspec (a local folder or the
moto S3 bucket, read around the fault proxy), so the driver's own reads never depend on the storage under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.conftest import component_pid, descendants, processes_mentioning, start_cli


@dataclass
class Run:
    workdir: Path
    out: str  # the run's output_dir: a local path or an s3:// URL
    args: tuple[str, ...]  # `rl` arguments before --output-dir (profiles, overrides)
    api: str | None
    fs: Any  # an fsspec filesystem that reads `out` without going through any injected fault
    cli: subprocess.Popen = field(init=False)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.workdir / "cli.log"

    def start(self, *extra: str) -> None:
        self.cli = start_cli(self.workdir, self.log, self.api, "rl", *self.args, "--output-dir", self.out, *extra)

    def resume(self, *extra: str) -> None:
        self.cli = start_cli(self.workdir, self.log, self.api, "resume", self.out, *extra)

    def progress(self) -> tuple[int, float]:
        """(rows in metrics.jsonl, the `time` of its last row): trained steps so far and when the last was recorded.
        Counting newlines and parsing one row keeps this cheap enough to poll every half second."""
        try:
            self.fs.invalidate_cache()
            data = self.fs.cat_file(f"{self.out}/metrics.jsonl")
        except (FileNotFoundError, OSError):
            return 0, 0.0
        lines = data.splitlines()
        for line in reversed(lines[-2:]):  # the last row may be cut short by a kill
            try:
                return data.count(b"\n"), float(json.loads(line)["time"])
            except (ValueError, KeyError, TypeError):
                continue
        return 0, 0.0

    def pid(self, target: str, timeout_s: float = 90.0) -> int | None:
        """The pid of `target` (trainer, orchestrator, inference), waiting across a restart; None if the run ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.cli.poll() is None:
            if (pid := component_pid(self.cli.pid, target)) is not None:
                return pid
            time.sleep(0.1)
        return None

    def kill(self, tree: bool) -> None:
        """SIGKILL the flow (CLI) process, or it and every descendant; waits until none of them runs."""
        victims = [self.cli.pid] + (descendants(self.cli.pid) if tree else [])
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.cli.wait(timeout=30)
        self.wait_gone()

    def wait_gone(self, timeout_s: float = 60.0) -> bool:
        """Until no process mentions the run's output_dir (the flow's components stop when it dies)."""
        deadline = time.monotonic() + timeout_s
        while processes_mentioning(self.out) and time.monotonic() < deadline:
            time.sleep(0.2)
        return not processes_mentioning(self.out)

    def stop(self) -> None:
        if self.cli.poll() is None:
            os.killpg(self.cli.pid, signal.SIGKILL)
            self.cli.wait(timeout=30)
        self.wait_gone()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]
