"""Collective weight transport (`weight_broadcast.type = "collective"`): trainer rank 0 -> inference engine.

The engine hosts a TCPStore listening on `weight_broadcast.host:port` only (127.0.0.1 by default: the
listening socket is bound here and handed to torch, whose own store would listen on every interface). The
trainer connects, takes the next *generation* number (`store.add`) and both sides form a 2-rank process
group (gloo, its sockets on the same address; NCCL on GPU) under that generation's key prefix: rank 0 the
trainer, rank 1 the engine. Per policy version the trainer, before its filesystem publication, writes an
announcement (`Announce`: version, tensor names, shapes, dtypes, payload MAC) under `gen/G/announce/S`,
sends the tensors one by one, and waits for the engine's acknowledgement. The engine's receiver thread
stages what it got by version; when the orchestrator's `/update_weights` names that version, the server
takes the staged tensors instead of reading the file (the file is still committed, and still read whenever
nothing was staged). Policy versions and the in-flight update semantics are the engine's, unchanged.

Authentication: anyone who can reach the store can read and write its keys, so nothing in it is trusted
without a MAC under the attempt's shared secret (config/transport.py TRANSPORT_SECRET_ENV, HMAC-SHA256).
A session starts with a challenge each way: the engine publishes a nonce, the trainer's `hello` for
generation G carries its own nonce and a MAC over both, and the engine's `welcome` a MAC the trainer checks
before it sends anything (so weights never go to a store that cannot prove the secret). Every announcement
is MAC'd over the session (G, sequence number, both nonces) and its body, and carries a MAC over the
tensors' bytes: the engine allocates nothing before the announcement verifies and fits its model's
parameters (names, shapes, known dtypes), and stages nothing whose received bytes do not verify. A forged,
replayed or tampered transfer costs that version the file read, never a wrong policy. What is not defended
(any client of the store can fill its memory or disturb a session; the bytes travel unencrypted) is in
docs/inference.md.

Restarts: a restarted trainer takes a new generation, which the receiver sees and joins; a restarted
engine hosts a new store, on which the trainer's next send fails, reconnects and takes generation 1.
Every wait is bounded by `timeout_s`; a failed transfer costs that version the file read, never a hang.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, cast

import torch

from config.transport import TRANSPORT_SECRET_ENV, WeightBroadcastConfig

log = logging.getLogger("rollflow.transport")
POLL_S = 0.02
SCAN = 8  # generations the engine looks back over for a trainer's hello (others may bump the counter)
NONCE_CHARS = 32
# What an announcement may declare: names the tensors' element types; anything else is refused unread.
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)}


class TransportError(RuntimeError):
    """A session or transfer that did not verify, or a transport that cannot run as configured."""


def transport_key(env: Mapping[str, str] = os.environ) -> bytes:
    """The MAC key, from the attempt's secret in the environment; refuses to run without one."""
    secret = env.get(TRANSPORT_SECRET_ENV, "")
    if len(secret) < 16:
        got = f"{len(secret)} characters" if secret else "nothing"
        raise TransportError(
            f'weight_broadcast.type = "collective" needs a shared secret of at least 16 characters in the '
            f"environment variable {TRANSPORT_SECRET_ENV} (the rl flow draws one per attempt for the inference "
            f"process and the trainer); got {got}"
        )
    return hashlib.sha256(b"rollflow weight transport\0" + secret.encode()).digest()


def _mac(key: bytes, *parts: str | int | bytes) -> bytes:
    """HMAC-SHA256 (hex) over the parts; every part but the last is a fixed-format label, number or nonce."""
    data = b"|".join(p if isinstance(p, bytes) else str(p).encode() for p in parts)
    return hmac.new(key, data, hashlib.sha256).hexdigest().encode()


def payload_mac(key: bytes, tensors: Iterable[torch.Tensor]) -> str:
    """HMAC-SHA256 over the tensors' raw bytes, in order (their shapes and dtypes are in the announcement)."""
    h = hmac.new(key, b"payload", hashlib.sha256)
    for t in tensors:
        h.update(cast(bytes, t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))  # a buffer, no copy
    return h.hexdigest()


@dataclass
class Announce:
    """What the trainer is about to send: policy `version`, then one tensor per name, in this order, whose
    bytes have the MAC `payload`."""

    version: int
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    payload: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Announce:
        return cls(**json.loads(data))

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise ValueError unless every tensor is one of the model's parameters, with its shape and a known
        dtype, at most once: what the engine would allocate is bounded by its own model."""
        if not (len(self.names) == len(self.shapes) == len(self.dtypes)) or len(set(self.names)) != len(self.names):
            raise ValueError("names, shapes and dtypes differ in length, or a name repeats")
        for name, shape, dtype in zip(self.names, self.shapes, self.dtypes, strict=True):
            if expected.get(name) != tuple(shape) or dtype not in DTYPES:
                raise ValueError(f"{name!r} {shape} {dtype} is not a parameter of the served model with that shape")
        if not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version {self.version!r} is not a policy version")


def _backend(cfg: WeightBroadcastConfig) -> str:
    if cfg.c10d_backend != "auto":
        return cfg.c10d_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, ValueError):
        return None


def _gloo_bind(host: str, peer_side: bool) -> str | None:
    """Where gloo's sockets listen: the configured address (the engine), or loopback when the trainer is
    on the engine's host; None (torch's default, the host name's address) for a wildcard or remote host."""
    addr = _address(host)
    if addr is None or addr.is_unspecified or (peer_side and not addr.is_loopback):
        return None
    return host


def _group(cfg: WeightBroadcastConfig, store, generation: int, rank: int, bind: str | None):
    """The 2-rank group of one generation; construction is the rendezvous (bounded by timeout_s). `bind`:
    the address gloo's own sockets listen on (None: torch's default, the host name's address)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"gen/{generation}/pg", store)
    timeout = timedelta(seconds=cfg.timeout_s)
    if _backend(cfg) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs omit it
    gloo._timeout = timeout
    gloo._devices = [
        dist.ProcessGroupGloo.create_device(hostname=bind) if bind else dist.ProcessGroupGloo.create_device()
    ]
    return dist.ProcessGroupGloo(prefixed, rank, 2, gloo)


def _device(cfg: WeightBroadcastConfig) -> str:
    return "cuda" if _backend(cfg) == "nccl" else "cpu"


def listening_store(host: str, port: int, timeout_s: float):
    """A master TCPStore that accepts connections on `host` only: the socket is bound and listening here,
    then handed over (torch closes it with the store). `port` 0 takes a free one (`store.port`)."""
    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted engine, same port
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise TransportError(f"weight_broadcast: cannot listen on {host}:{port}: {exc}") from exc
    bound = sock.getsockname()[1]
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(
        host, bound, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach()
    )


class Sender:
    """The trainer's side (rank 0 only). `send` returns the seconds it took, or None when the transfer
    failed (the engine then reads the filesystem publication); it never raises and never blocks longer
    than about twice `timeout_s`. `key`: the MAC key (default: from the environment, `transport_key`)."""

    def __init__(self, cfg: WeightBroadcastConfig, key: bytes | None = None):
        self.cfg, self.key = cfg, key or transport_key()
        self.store: Any = None
        self.pg: Any = None
        self.generation = self.seq = 0
        self.session: tuple[str, str] = ("", "")  # (engine nonce, trainer nonce)
        self.bind = _gloo_bind(cfg.host, peer_side=True)

    def _connect(self) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=self.cfg.timeout_s)
        self.store = dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False, timeout=timeout)
        self.generation, self.seq = int(self.store.add("generation", 1)), 0
        engine, trainer = self.store.get("engine")[:NONCE_CHARS].decode(errors="replace"), secrets.token_hex(16)
        g = self.generation
        self.store.set(f"gen/{g}/hello", f"{trainer}:".encode() + _mac(self.key, "hello", g, engine, trainer))
        self.store.wait([f"gen/{g}/welcome"], timeout)
        if not hmac.compare_digest(self.store.get(f"gen/{g}/welcome"), _mac(self.key, "welcome", g, engine, trainer)):
            raise TransportError("the store's engine did not prove the transport secret; no weights sent to it")
        self.session = (engine, trainer)
        self.pg = _group(self.cfg, self.store, g, rank=0, bind=self.bind)
        log.info(f"weight transport: joined the engine's group (generation {g})")

    def _transfer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        assert self.store is not None and self.pg is not None
        names = sorted(state)
        tensors = [state[n].detach() for n in names]
        shapes, dtypes = [list(t.shape) for t in tensors], [str(t.dtype) for t in tensors]
        body = Announce(version, names, shapes, dtypes, payload_mac(self.key, tensors)).encode()
        self.seq += 1
        g, (engine, trainer) = self.generation, self.session
        self.store.set(
            f"gen/{g}/announce/{self.seq}", _mac(self.key, "announce", g, self.seq, engine, trainer, body) + body
        )
        device = _device(self.cfg)
        for i, t in enumerate(tensors):
            self.pg.send([t.to(device).contiguous()], 1, i).wait()
        ack = f"gen/{g}/ack/{self.seq}"
        self.store.wait([ack], timedelta(seconds=self.cfg.timeout_s))
        if self.store.get(ack) != b"1":
            raise TransportError(f"the engine refused version {version} (it did not verify)")

    def send(self, version: int, state: dict[str, torch.Tensor]) -> float | None:
        t0 = time.perf_counter()
        for attempt in (1, 2):  # the second try re-forms the group: the engine may have restarted
            try:
                if self.pg is None:
                    self._connect()
                self._transfer(version, state)
                return time.perf_counter() - t0
            except Exception as exc:  # a broken group must not stop training: the file is the fallback
                log.warning(f"weight transport: version {version} not sent (try {attempt}): {exc}")
                self.store = self.pg = None
        return None


class Receiver:
    """The engine's side: hosts the store, joins each generation whose trainer proves the secret, receives
    announced versions in a thread and stages those that verify. `expected`: the served model's parameters
    (name -> shape), the only tensors it accepts. `take(version)` returns the staged state dict of that
    version (waiting while it is still arriving) or None."""

    def __init__(
        self,
        cfg: WeightBroadcastConfig,
        expected: Mapping[str, Sequence[int]],
        keep: int = 2,
        key: bytes | None = None,
    ):
        self.cfg, self.keep, self.key = cfg, keep, key or transport_key()
        self.expected = {name: tuple(shape) for name, shape in expected.items()}
        self.max_announce = 4096 + 512 * len(self.expected)  # the longest announcement of these parameters
        self._server = listening_store(cfg.host, cfg.port, cfg.timeout_s)
        self.store, self.port = self._server, self._server.port
        self.nonce = secrets.token_hex(NONCE_CHARS // 2)
        self.store.set("engine", self.nonce)
        self._cv = threading.Condition()
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.receiving: int | None = None
        self._stop = threading.Event()
        self.stats = {"received": 0, "failed": 0, "generations": 0, "refused": 0}
        self._thread = threading.Thread(target=self._loop, name="weight-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def take(self, version: int) -> dict[str, torch.Tensor] | None:
        deadline = time.monotonic() + self.cfg.timeout_s
        with self._cv:
            while self.receiving == version and time.monotonic() < deadline:
                self._cv.wait(POLL_S * 5)
            return self.staged.get(version)

    def _generation(self) -> int:
        """The trainers' counter, read without `add` (the store drops a connection whose `add` meets a value
        that is not a number, which any client can write there): anything but a number reads as 0."""
        if not self.store.check(["generation"]):
            return 0
        value = self.store.get("generation")
        return int(value) if value.isdigit() and len(value) < 19 else 0

    def _poll(self, joined: int) -> tuple[int, str] | None:
        """`_hello_after`, outliving a connection another client's writes broke: then a fresh client
        connection to our own store (the server stays `self._server`) and None this time."""
        import torch.distributed as dist

        try:
            return self._hello_after(joined)
        except Exception as exc:
            log.warning(f"weight transport: store unreadable ({exc}); reconnecting")
        time.sleep(POLL_S * 25)
        try:
            timeout = timedelta(seconds=self.cfg.timeout_s)
            self.store = dist.TCPStore(self.cfg.host, self.port, is_master=False, timeout=timeout)
        except Exception as exc:
            log.warning(f"weight transport: cannot reconnect to the store: {exc}")
        return None

    def _hello_after(self, joined: int) -> tuple[int, str] | None:
        """(generation, trainer nonce) of the newest generation after `joined` whose hello verifies."""
        newest = self._generation()
        for g in range(newest, max(joined, newest - SCAN), -1):
            key = f"gen/{g}/hello"
            if not self.store.check([key]):
                continue
            trainer, _, mac = self.store.get(key)[: NONCE_CHARS + 65].partition(b":")
            nonce = trainer.decode(errors="replace")
            if hmac.compare_digest(mac, _mac(self.key, "hello", g, self.nonce, nonce)):
                return g, nonce
        return None

    def _loop(self) -> None:
        joined = 0
        while not self._stop.is_set():
            hello = self._poll(joined)
            if hello is None:
                time.sleep(POLL_S)
                continue
            joined, trainer = hello
            try:
                self.store.set(f"gen/{joined}/welcome", _mac(self.key, "welcome", joined, self.nonce, trainer))
                self._serve(joined, trainer)
            except Exception as exc:  # the trainer went away or restarted: wait for its next generation
                self.stats["failed"] += 1
                log.warning(f"weight transport: generation {joined} ended: {exc}")
            finally:
                with self._cv:
                    self.receiving = None
                    self._cv.notify_all()

    def _serve(self, generation: int, trainer: str) -> None:
        """Receive this session's announcements until a newer trainer proves the secret (or we stop)."""
        pg = _group(self.cfg, self.store, generation, rank=1, bind=_gloo_bind(self.cfg.host, peer_side=False))
        self.stats["generations"] += 1
        log.info(f"weight transport: trainer joined (generation {generation})")
        seq = 0
        while not self._stop.is_set():
            key = f"gen/{generation}/announce/{seq + 1}"
            if self.store.check([key]):
                seq += 1
                ok = self._receive(pg, self._verified(generation, seq, trainer, self.store.get(key)))
                self.store.set(f"gen/{generation}/ack/{seq}", "1" if ok else "refused")
            elif self._generation() > generation and self._hello_after(generation) is not None:
                return
            else:
                time.sleep(POLL_S)

    def _verified(self, generation: int, seq: int, trainer: str, value: bytes) -> Announce | None:
        """The announcement if its MAC verifies and it fits the model; None (logged) otherwise."""
        mac, body = value[:64], value[64:]
        why = ""
        if len(value) > self.max_announce:
            why = f"{len(value)} bytes, more than any announcement of this model"
        elif not hmac.compare_digest(mac, _mac(self.key, "announce", generation, seq, self.nonce, trainer, body)):
            why = "its MAC does not verify"
        else:
            try:
                ann = Announce.decode(body)
                ann.check(self.expected)
                return ann
            except (ValueError, TypeError) as exc:
                why = str(exc)
        self.stats["refused"] += 1
        log.warning(f"weight transport: announcement {generation}/{seq} refused: {why}")
        return None

    def _receive(self, pg, ann: Announce | None) -> bool:
        """Receive the announced tensors; stage them if their bytes verify. False: nothing staged."""
        if ann is None:
            return False
        with self._cv:
            self.receiving = ann.version
        device = _device(self.cfg)
        tensors = []
        for i, (shape, dtype) in enumerate(zip(ann.shapes, ann.dtypes, strict=True)):
            buf = torch.empty(shape, dtype=DTYPES[dtype], device=device)
            pg.recv([buf], 0, i).wait()
            tensors.append(buf.cpu() if device != "cpu" else buf)
        ok = hmac.compare_digest(payload_mac(self.key, tensors), ann.payload)
        with self._cv:
            if ok:
                self.staged[ann.version] = dict(zip(ann.names, tensors, strict=True))
                for old in sorted(self.staged)[: -self.keep]:
                    del self.staged[old]
                self.stats["received"] += 1
            self.receiving = None
            self._cv.notify_all()
        if not ok:
            self.stats["refused"] += 1
            log.warning(f"weight transport: version {ann.version} refused: its bytes do not verify")
        return ok
