"""Two vLLM replicas behind vllm-router on one host, launched by the `rl` flow (inference.deployment.type =
"multi_node", num_nodes = 2, every node 127.0.0.1), serving a shortened run.

What is asserted comes from the replicas' own logs (`--enable-log-requests`: each vLLM server logs
`Received request cmpl-<X-Request-Id>-0: ...` once per HTTP request, the vLLM backend makes that id
`<session>-<random>`, and the entry module prefixes every line with the server's name), never from our
client:
- consistent_hash (default): every request of a session reached one replica, across the flow's restart,
  and the sessions were spread over both; a vLLM replica SIGKILLed mid-run is survived by the flow's
  restart from the last checkpoint, and the run finishes. The one exception is the failover window, from
  the kill to the restarted attempt's `vLLM ready`: vllm-router sends the dead replica's sessions to the
  survivor then, and the same sessions (session ids are deterministic: step and group) return to their
  own replica when the restart samples those steps again.
- round_robin: the run's requests were spread evenly over both replicas.

vLLM on CPU takes ~35-160 s to start, so the default test starts the pair twice (the second after the
kill) and checks everything on that one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import TINY, processes_mentioning, start_cli

from engines.protocol import SESSION_HEADER

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# Two vLLM servers behind one vllm-router; several replicas: each replica's only server, no router.
MULTI_NODE = ("--inference.deployment.type", "multi_node", "--inference.deployment.num_nodes", "2")
REPLICAS = ("--inference.deployment.type", "single_node", "--inference.num_infer_replicas", "2")
KILLED = "vllm-r0-node1"  # the replica the test kills: the second server, on backend_port + 1
RECEIVED = re.compile(r"^\[(vllm-r\d+(?:-node\d+)?)\] .*Received request cmpl-([\w.-]+?)-[0-9a-f]{8}-\d+: ")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}: run make vllm"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 free too (the two vLLM servers listen on backend_port and backend_port + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def start_run(out: Path, policy: str, steps: int, shape: tuple[str, ...] = MULTI_NODE):
    ports = {"inference": free_port(), "backend": free_port_pair(), "router": free_port(), "metrics": free_port()}
    while {ports["inference"], ports["router"], ports["metrics"]} & {ports["backend"], ports["backend"] + 1}:
        ports["backend"] = free_port_pair()
    args = ["rl", "@", str(TINY), "--output-dir", str(out), "--max-steps", str(steps), "--sft.steps", "30"]
    args += ["--orchestrator.batch_size", "8", "--orchestrator.inference_timeout_s", "900"]
    args += ["--checkpoint.interval", "2", "--restart.backoff_s", "0.1"]
    args += ["--inference.backend", "vllm", "--inference.port", str(ports["inference"])]
    args += [*shape, "--inference.deployment.backend_port", str(ports["backend"])]
    args += ["--inference.router.policy", policy, "--inference.router.port", str(ports["router"])]
    args += ["--inference.router.metrics_port", str(ports["metrics"])]
    args += ["--inference.vllm_extra.enforce_eager", "true", "--inference.vllm_extra.enable_log_requests", "true"]
    out.parent.mkdir(parents=True, exist_ok=True)
    return start_cli(out.parent, out.parent / "cli.log", None, *args), ports


@dataclass(frozen=True)
class Served:
    """One HTTP request as a vLLM server logged it."""

    attempt: int  # the flow's attempt: each begins at the entry module's `vLLM ready` line
    replica: str
    line: int  # its line number in inference.log


def served_by(out: Path) -> dict[str, list[Served]]:
    """session -> each of its requests, from the vLLM servers' own log lines."""
    sessions: dict[str, list[Served]] = defaultdict(list)
    attempt = 0
    for i, line in enumerate(read_lines(out)):
        if line.startswith("vLLM ready in"):
            attempt += 1
        elif m := RECEIVED.match(line):
            sessions[m.group(2)].append(Served(attempt, m.group(1), i))
    return sessions


def read_lines(out: Path) -> list[str]:
    path = out / "logs" / "inference.log"
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def log_lines(out: Path) -> int:
    return len(read_lines(out))


def last_ready_line(out: Path) -> int:
    return max(i for i, line in enumerate(read_lines(out)) if line.startswith("vLLM ready in"))


def victim_busy(line: str) -> bool:
    """A request received by the replica the test kills (node 1)."""
    return bool((m := RECEIVED.match(line)) and m.group(1) == KILLED)


def vllm_server_pid(port: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            return int(pid)
    return None


async def sessions_of_our_own(url: str, n_sessions: int = 12, turns: int = 3) -> None:
    """Sessions of several turns each (as a multi-turn episode sends), through the front end like the
    orchestrator's requests; a session's turns one after another, the sessions side by side."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def session(s: int) -> None:
            for _ in range(turns):
                body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "n": 1, "return_token_ids": True}
                r = await client.post("/v1/completions", json=body, headers={SESSION_HEADER: f"test.{s}"})
                assert r.status_code == 200, r.text

        await asyncio.gather(*(session(s) for s in range(n_sessions)))


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def kill_then_send_sessions(cli, out: Path, port: int, url: str, done: list) -> None:
    try:
        done.append(_kill_then_send_sessions(cli, out, port, url))
    except BaseException as exc:  # reported by the test after the run
        done.append(exc)


def _kill_then_send_sessions(cli, out: Path, port: int, url: str) -> tuple[int, int]:
    """SIGKILL the vLLM server on `port` once a checkpoint exists; once the flow has brought inference
    back (a new attempt from that checkpoint), send our sessions. Returns the killed pid and how many
    lines inference.log had just before the kill."""
    deadline = time.monotonic() + 1800  # two vLLM starts: up to ~6 min each on a loaded 2-core machine
    while not list((out / "checkpoints").glob("step=*/trainer/_manifest.json")):
        assert cli.poll() is None, (out.parent / "cli.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    pid = vllm_server_pid(port)
    assert pid is not None, f"no vLLM server on port {port}"
    seen = log_lines(out)
    while not any(victim_busy(line) for line in read_lines(out)[seen:]):  # kill it with requests in flight
        assert cli.poll() is None and time.monotonic() < deadline, "the replica got no request after the checkpoint"
        time.sleep(0.05)
    killed_at = log_lines(out)
    os.kill(pid, signal.SIGKILL)
    log = out / "logs" / "inference.log"
    while f"vLLM process {pid} exited" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the entry module did not notice the kill"
        time.sleep(0.2)
    while vllm_server_pid(port) in (None, pid) or not healthy(url):
        assert cli.poll() is None and time.monotonic() < deadline, "inference did not come back"
        time.sleep(0.5)
    asyncio.run(sessions_of_our_own(url))
    return pid, killed_at


def finish(cli, out: Path, timeout_s: float = 1800) -> str:
    try:
        cli.wait(timeout_s)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    log = (out.parent / "cli.log").read_text(errors="replace")
    assert cli.returncode == 0, log[-4000:]
    deadline = time.monotonic() + 60
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(out)) == [], "a vLLM or router process outlived the run"
    return log


@pytest.mark.long  # two vLLM replicas started twice (~4 min): `make test-long`
def test_consistent_hash_keeps_sessions_on_a_replica_and_a_killed_replica_is_survived(tmp_path):
    out = tmp_path / "run"
    cli, ports = start_run(out, "consistent_hash", steps=8)
    done: list = []
    url = f"http://127.0.0.1:{ports['inference']}"
    killer = threading.Thread(target=kill_then_send_sessions, args=(cli, out, ports["backend"] + 1, url, done))
    killer.start()
    log = finish(cli, out)
    killer.join(5)
    assert done and isinstance(done[0], tuple), f"sending our sessions or killing the replica failed: {done!r}"
    pid, killed_at = done[0]
    inference_log = (out / "logs" / "inference.log").read_text(errors="replace")
    assert f"vLLM process {pid} exited with code -9; stopping" in inference_log
    assert "restart 1/" in log, "the killed replica did not make the flow restart"
    assert json.loads((out / "state.json").read_text())["status"] == "finished"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][-1] == 8
    # vLLM's sampler logprobs against the trainer's: fp32 on both sides, so only kernel rounding separates them:
    # measured 0 to 3.2e-10 per step behind the router, up to 3.5e-9 with one server (docs/inference.md).
    # Not measurable for a step sampled by a policy the restart rolled back (published after the checkpoint).
    measured = [m["mismatch_kl"] for m in metrics if m["mismatch_kl"] is not None]
    print(f"mismatch_kl: {measured}")
    assert len(measured) >= len(metrics) - 2 and max(measured) < 1e-7, metrics
    check_affinity(served_by(out), killed_at, last_ready_line(out))


def check_affinity(sessions: dict[str, list[Served]], killed_at: int, back_at: int) -> None:
    """Every session on one replica, leaving out the failover window [killed_at, back_at) of the log; both
    replicas served sessions after the restart, and our 12 sessions of 3 turns were all served then."""
    last = max(s.attempt for served in sessions.values() for s in served)
    ours = {k: v for k, v in sessions.items() if k.startswith("test.")}
    assert len(ours) == 12 and all(len(v) == 3 and {s.attempt for s in v} == {last} for v in ours.values()), ours
    outside = {k: [s for s in v if not killed_at <= s.line < back_at] for k, v in sessions.items()}
    split = {k: v for k, v in outside.items() if len({s.replica for s in v}) > 1}
    assert not split, f"sessions served by both replicas outside the failover window: {split}"
    after_restart = {s.replica for served in sessions.values() for s in served if s.attempt == last}
    assert after_restart == {"vllm-r0-node0", KILLED}, "the sessions were not spread over both replicas"
    assert sum(len(v) for v in outside.values()) >= 0.8 * sum(len(v) for v in sessions.values())


@pytest.mark.long  # two vLLM replicas (~2.5 min): `make test-long`
def test_round_robin_spreads_a_run_over_both_replicas(tmp_path):
    out = tmp_path / "run"
    cli, _ = start_run(out, "round_robin", steps=3)
    finish(cli, out)
    counts: dict[str, int] = defaultdict(int)
    for served in served_by(out).values():
        for s in served:
            counts[s.replica] += 1
    assert set(counts) == {"vllm-r0-node0", "vllm-r0-node1"}, counts
    a, b = counts.values()
    assert abs(a - b) <= 0.2 * (a + b), f"round robin left the replicas unbalanced: {counts}"


@pytest.mark.long
def test_two_replicas_split_the_sessions_between_them(tmp_path):
    """inference.num_infer_replicas = 2 (single-node replicas): the vLLM backend hashes each session to a replica."""
    out = tmp_path / "run"
    cli, _ = start_run(out, "consistent_hash", steps=3, shape=REPLICAS)
    finish(cli, out)
    sessions = served_by(out)
    # the vLLM backend's rule (engines/inference/vllm/backend.py Upstream.entry): replica = crc32(session) mod replicas
    wrong = {k: v for k, v in sessions.items() if {s.replica for s in v} != {f"vllm-r{zlib.crc32(k.encode()) % 2}"}}
    assert not wrong, f"sessions not on their replica: {wrong}"
    counts: dict[str, int] = defaultdict(int)
    for served in sessions.values():
        counts[served[0].replica] += 1
    assert set(counts) == {"vllm-r0", "vllm-r1"}, counts
