"""Collective weight transport over real gloo groups on loopback: a trainer-side `Sender` in a separate
process (or this one) and the engine-side `Receiver`; restarts of either side re-form the group; hostile
clients of the engine's store (no secret, a forged or replayed announcement, tampered bytes, shapes the model
does not have) stage nothing; the store listens on its configured address only."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from config.model import ModelConfig
from config.transport import TRANSPORT_SECRET_ENV, WeightBroadcastConfig
from engines.weight_transport import Announce, Receiver, Sender, TransportError, _mac, transport_key
from runtime.rundir import free_port

pytestmark = pytest.mark.slow
SECRET = "test-transport-secret-0123456789"
KEY = transport_key({TRANSPORT_SECRET_ENV: SECRET})
MODEL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=64)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}


def _params(seed: int = 0) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in _state(seed).items()}


def _receiver(cfg: WeightBroadcastConfig) -> Receiver:
    return Receiver(cfg, _params(), key=KEY)


def _wait_staged(rx: Receiver, version: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := rx.take(version)) is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"version {version} never arrived: {rx.stats}")


SENDER = """
import sys, torch
from config.model import ModelConfig
from config.transport import WeightBroadcastConfig
from engines.weight_transport import Sender
sys.path.insert(0, "tests/integration")
from test_weight_transport import _state
cfg = WeightBroadcastConfig(type="collective", port=int(sys.argv[1]), timeout_s=10)
print(Sender(cfg).send(int(sys.argv[2]), _state(int(sys.argv[2]))), flush=True)
"""


@pytest.fixture()
def cfg():
    return WeightBroadcastConfig(type="collective", port=free_port("127.0.0.1"), timeout_s=5)


def test_versions_arrive_exactly_and_a_restarted_trainer_rejoins(cfg):
    rx = _receiver(cfg)
    try:
        assert Sender(cfg, KEY).send(1, _state(1)) is not None  # the first trainer, then it goes away
        argv = [sys.executable, "-c", SENDER, str(cfg.port), "2"]  # a restarted trainer: a new process
        env = {**os.environ, TRANSPORT_SECRET_ENV: SECRET}  # the secret as the flow hands it over
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0 and proc.stdout.strip() != "None", proc.stdout + proc.stderr[-2000:]
        for version in (1, 2):
            got, want = _wait_staged(rx, version), _state(version)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            assert got["b.bias"].dtype == torch.bfloat16
        assert rx.stats["generations"] == 2 and rx.stats["received"] == 2
    finally:
        rx.stop()


def test_a_restarted_engine_is_rejoined_and_a_missing_one_costs_a_bounded_wait(cfg):
    tx = Sender(cfg.model_copy(update={"timeout_s": 2}), KEY)
    t0 = time.monotonic()
    assert tx.send(1, _state(1)) is None  # nobody listening: refused, within the bound
    assert time.monotonic() - t0 < 15
    rx = _receiver(cfg)
    assert tx.send(2, _state(2)) is not None and torch.equal(_wait_staged(rx, 2)["a.weight"], _state(2)["a.weight"])
    rx.stop()
    rx._thread.join(5)
    del rx
    rx2 = _receiver(cfg)  # the engine restarted on the same port: a fresh store, generation 1 again
    try:
        assert tx.send(3, _state(3)) is not None
        assert torch.equal(_wait_staged(rx2, 3)["a.weight"], _state(3)["a.weight"])
        assert rx2.take(2) is None  # what the old engine staged is gone with it
    finally:
        rx2.stop()


class _Tampering:
    """A man in the middle on the group's wire: every tensor arrives with its first element changed."""

    def __init__(self, pg):
        self.pg = pg

    def send(self, tensors, dst, tag):
        forged = tensors[0].clone()
        forged.view(-1)[0] += 1
        return self.pg.send([forged], dst, tag)


def _hostile_announces(rx: Receiver, tx: Sender, evil) -> list[int]:
    """Write three announcements into the trainer's live session from a raw store client; their versions."""
    g, seq, (engine, trainer) = tx.generation, tx.seq, tx.session
    replay = evil.get(f"gen/{g}/announce/{seq}")  # the trainer's last one, verbatim, as the next
    evil.set(f"gen/{g}/announce/{seq + 1}", replay)
    own_key = transport_key({TRANSPORT_SECRET_ENV: "an attacker's own secret, not the run's"})
    huge = Announce(7, ["a.weight"], [[1 << 40]], ["torch.float32"], "0" * 64).encode()  # 4 TiB if allocated
    evil.set(f"gen/{g}/announce/{seq + 2}", _mac(own_key, "announce", g, seq + 2, engine, trainer, huge) + huge)
    # even with the run's key (a trainer of another model), what the model does not have is never allocated
    bad = Announce(8, ["a.weight", "c.extra"], [[1 << 20, 1 << 20], [4]], ["torch.float32"] * 2, "0" * 64).encode()
    evil.set(f"gen/{g}/announce/{seq + 3}", _mac(KEY, "announce", g, seq + 3, engine, trainer, bad) + bad)
    deadline = time.monotonic() + 10
    acks = [f"gen/{g}/ack/{seq + i}" for i in (1, 2, 3)]
    while not evil.check(acks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [evil.get(k) for k in acks] == [b"refused"] * 3, rx.stats
    return [1, 7, 8]


def test_hostile_store_clients_stage_nothing_and_the_trainer_still_gets_through():
    """A raw TCPStore client of the engine's store: a session without the secret, a replayed, a forged and an
    oversized announcement, and tampered bytes on the wire; nothing of theirs is staged and the engine keeps
    serving the genuine trainer."""
    cfg = WeightBroadcastConfig(type="collective", port=free_port("127.0.0.1"), timeout_s=1.5)
    rx = _receiver(cfg)
    try:
        evil = dist.TCPStore("127.0.0.1", cfg.port, is_master=False, timeout=timedelta(seconds=5))
        g = int(evil.add("generation", 1))  # a session of its own, signed with a guess
        evil.set(f"gen/{g}/hello", "ab" * 16 + ":" + "0" * 64)
        tx = Sender(cfg, KEY)
        assert tx.send(1, _state(1)) is not None and tx.generation == g + 1  # the genuine trainer gets through
        assert not evil.check([f"gen/{g}/welcome"]) and rx.stats["generations"] == 1
        tx.pg = _Tampering(tx.pg)
        assert tx.send(2, _state(2)) is not None  # refused on arrival; the retry's fresh group carries it
        assert rx.stats["refused"] == 1 and torch.equal(_wait_staged(rx, 2)["a.weight"], _state(2)["a.weight"])
        forged = _hostile_announces(rx, tx, evil)
        assert tx.send(3, _state(3)) is not None  # its session desynchronised: one bounded retry
        assert torch.equal(_wait_staged(rx, 3)["a.weight"], _state(3)["a.weight"])
        evil.set("generation", "not a number")  # a counter torch's store cannot `add` to any more
        assert tx.send(4, _state(4)) is not None and torch.equal(_wait_staged(rx, 4)["b.bias"], _state(4)["b.bias"])
        assert rx.stats["refused"] == 4 and rx.stats["received"] == 4 and rx._thread.is_alive()
        assert all(rx.take(v) is None for v in forged)  # the replayed 1 is not staged again (3 and 4 are kept)
    finally:
        rx.stop()


def test_an_impostor_on_the_port_gets_no_weights_and_a_taken_port_stops_the_engine_clearly():
    """Ports are chosen before the engine binds them: another local user may take one first. The trainer
    then finds a store that cannot answer its challenge, and sends nothing; the engine refuses to start."""
    cfg = WeightBroadcastConfig(type="collective", port=free_port("127.0.0.1"), timeout_s=0.5)
    impostor = dist.TCPStore("127.0.0.1", cfg.port, is_master=True, wait_for_workers=False)
    impostor.set("engine", "ab" * 16)
    assert Sender(cfg, KEY).send(1, _state(1)) is None
    assert int(impostor.add("generation", 0)) == 2  # it tried twice (hello, no welcome) ...
    assert not impostor.check(["gen/1/announce/1"]) and not impostor.check(["gen/2/announce/1"])  # ... sent nothing
    with pytest.raises(TransportError, match=f"cannot listen on 127.0.0.1:{cfg.port}"):
        _receiver(cfg)


def test_either_side_refuses_to_run_without_the_attempts_secret():
    for env in ({}, {TRANSPORT_SECRET_ENV: "short"}):
        with pytest.raises(TransportError, match=f"{TRANSPORT_SECRET_ENV}.*the rl flow draws one per attempt"):
            transport_key(env)
    assert transport_key({TRANSPORT_SECRET_ENV: SECRET}) != transport_key({TRANSPORT_SECRET_ENV: SECRET + "x"})


def _serve_collective(root: str, port: int, secret: str) -> tuple[subprocess.Popen, httpx.Client]:
    """A real `python -m engines.inference` (embedded, collective transport) on 127.0.0.1, healthy."""
    from config.inference import InferenceConfig
    from config.process import ComponentPaths, InferenceProcessConfig
    from config.storage import StorageConfig
    from engines.protocol import ADMIN_TOKEN_ENV

    cfg = InferenceProcessConfig(
        run=ComponentPaths(output_dir=root, run_id="t", storage=StorageConfig()),
        model=MODEL,
        inference=InferenceConfig(port=free_port("127.0.0.1")),
        weight_broadcast=WeightBroadcastConfig(type="collective", port=port, timeout_s=2),
        seed=0,
    )
    Path(root, "inference.json").write_text(cfg.model_dump_json())
    env = {**os.environ, ADMIN_TOKEN_ENV: "admin-token", TRANSPORT_SECRET_ENV: secret}
    argv = [sys.executable, "-m", "engines.inference", "--config", f"{root}/inference.json"]
    proc = subprocess.Popen(argv, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{cfg.inference.port}", timeout=60)
    client.headers["Authorization"] = "Bearer admin-token"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if client.get("/health").status_code == 200:
                return proc, client
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the inference server did not become healthy")


def _model_state(version: int, root: str) -> dict[str, torch.Tensor]:
    """Version `version`'s weights, published to the run's filesystem as the trainer does."""
    from engines.models.decoder import CausalLM
    from engines.models.tokenizer import CharTokenizer
    from storage import weights
    from storage.fs import get_fs

    torch.manual_seed(version)
    state = CausalLM(MODEL, CharTokenizer().vocab_size).publishable_state_dict()
    fs, r = get_fs(root)
    weights.publish(fs, r, version, state)
    return state


def test_through_the_server_a_forged_version_is_read_from_the_file(tmp_path):
    """The real server: a store client without the secret stages nothing, so /update_weights reads the
    file for that version; the genuine trainer's versions still arrive over the group."""
    root, port = str(tmp_path), free_port("127.0.0.1")
    _model_state(0, root)
    proc, client = _serve_collective(root, port, SECRET)
    try:
        tx = Sender(WeightBroadcastConfig(type="collective", port=port, timeout_s=1), KEY)
        assert tx.send(1, _model_state(1, root)) is not None
        r = client.post("/update_weights", json={"version": 1})
        assert r.status_code == 200 and r.json()["source"] == "collective", r.text
        evil = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        g, seq = tx.generation, tx.seq
        forged = Announce(2, ["lm_head.weight"], [[1, 1]], ["torch.float32"], "0" * 64).encode()
        evil.set(f"gen/{g}/announce/{seq + 1}", b"0" * 64 + forged)  # version 2, before the trainer's
        evil.set("generation", "100")  # and a generation of its own, unsigned
        deadline = time.monotonic() + 10
        while not evil.check([f"gen/{g}/ack/{seq + 1}"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert evil.get(f"gen/{g}/ack/{seq + 1}") == b"refused"
        _model_state(2, root)  # the trainer published 2 without sending it (as after a failed send)
        r = client.post("/update_weights", json={"version": 2})
        assert r.status_code == 200 and r.json()["source"] == "filesystem", r.text
        assert tx.send(3, _model_state(3, root)) is not None  # the genuine trainer: one bounded retry
        r = client.post("/update_weights", json={"version": 3})
        assert r.json()["source"] == "collective" and client.get("/health").json()["policy_version"] == 3
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def _listeners() -> set[tuple[str, int, int]]:
    """(address, port, inode) of the TCP sockets listening on this machine (IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                hexaddr, port = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per-word byte order
                found.add((str(ipaddress.ip_address(words)), int(port, 16), int(fields[9])))
    return found


def _own(inodes: set[int]) -> set[int]:
    """The socket inodes among `inodes` that this process holds."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(int(target[8:-1]))
    return inodes & held


def _non_loopback_address() -> str | None:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except OSError:
        return None
    return next((a for a in out if "." in a and not a.startswith("127.")), None)


def test_the_store_and_the_group_listen_on_the_configured_address_only():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the store from")
    cfg = WeightBroadcastConfig(type="collective", port=free_port("127.0.0.1"), timeout_s=5)
    before = _listeners()
    rx = _receiver(cfg)
    try:
        assert Sender(cfg, KEY).send(1, _state(1)) is not None  # the group's own sockets exist now too
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, cfg.port), timeout=2).close()
        socket.create_connection(("127.0.0.1", cfg.port), timeout=2).close()
        new = {entry for entry in _listeners() - before if entry[2] in _own({e[2] for e in _listeners()})}
        assert new and all(ipaddress.ip_address(a).is_loopback for a, _, _ in new), new
    finally:
        rx.stop()


@pytest.mark.long  # a whole flow run (~40 s idle); the transport itself is covered by the tests above
def test_a_collective_run_serves_every_version_from_the_group(tmp_path, prefect_api):
    import json
    from pathlib import Path

    from conftest import cli_argv, cli_env

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    profiles = ["@", str(root / "profiles/tiny-cpu.toml"), "@", str(root / "tests/profiles/collective-short.toml")]
    argv = cli_argv("rl", *profiles, "--output-dir", str(out))
    proc = subprocess.run(argv, cwd=tmp_path, env=cli_env(prefect_api), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["broadcast_s"] is not None for r in rows)
    kls = [r["mismatch_kl"] for r in rows if r["mismatch_kl"] is not None]
    assert kls and max(kls) < 1e-6, kls  # the same weights as the files: mismatch_kl as with the filesystem
    log = (out / "logs" / "orchestrator.log").read_text()
    served = [line for line in log.splitlines() if "engine now serves policy version" in line]
    assert served and all("from collective" in line for line in served), served
    assert (out / "weights" / "step=000006" / "model.safetensors").exists()  # still published
