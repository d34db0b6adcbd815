"""A real `rollflow rl` that loses its lease mid-run (another flow's lease written over it, as a takeover does)
stops its attempt and its components, commits nothing more, and leaves state.json and the lease to the taker."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, processes_mentioning, start_cli

RESUME = ROOT / "tests" / "profiles" / "resume.toml"  # lease_ttl_s = 10: renewals every 2.5 s


def _manifests(out: Path) -> dict[str, float]:
    return {str(p.relative_to(out)): p.stat().st_mtime for p in out.glob("*/step=*/**/_manifest.json")}


@pytest.mark.long  # a real tiny RL run (~3 min here)
def test_a_real_run_that_loses_its_lease_stops_and_commits_nothing_more(tmp_path):
    out, log = tmp_path / "run", tmp_path / "cli.log"
    cli = start_cli(tmp_path, log, None, "rl", "@", str(TINY), "@", str(RESUME), "--output-dir", str(out))
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("rollouts/step=000002/_manifest.json")):
            assert time.monotonic() < deadline and cli.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        lease = json.loads((out / "lease.json").read_text())
        taker = {**lease, "owner": "taker", "host": "node-b", "pid": 1, "generation": lease["generation"] + 1}
        (out / "lease.json.new").write_text(json.dumps(taker))
        os.replace(out / "lease.json.new", out / "lease.json")
        stolen_at, before = time.time(), _manifests(out)
        state_before = (out / "state.json").read_text()
        while "lost the lease" not in log.read_text() and time.time() - stolen_at < 30:
            time.sleep(0.1)
        noticed = time.time() - stolen_at
        rc = cli.wait(timeout=90)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    text = log.read_text()
    print(f"the flow saw its lease lost {noticed:.1f}s after the takeover")
    assert rc != 0 and "lost the lease" in text and "LeaseLost" in text, text[-3000:]
    assert noticed < 10 / 4 + 2  # at its next renewal (every ttl/4)
    late = {k: t for k, t in _manifests(out).items() if k not in before or t != before[k]}
    assert len(late) <= 1, late  # at most a commit whose check passed just before the takeover
    assert (out / "state.json").read_text() == state_before  # closing the run is the taker's business
    assert json.loads((out / "lease.json").read_text())["owner"] == "taker"
    deadline = time.monotonic() + 30
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(out)) == []
