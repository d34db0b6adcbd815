"""Collective weight transport (`weight_broadcast.type = "collective"`): trainer rank 0 -> inference engine.

The engine hosts a TCPStore on `weight_broadcast.host:port` (127.0.0.1 by default). The trainer connects,
takes the next *generation* number (`store.add`) and both sides form a 2-rank process group (gloo; NCCL on
GPU) under that generation's key prefix: rank 0 the trainer, rank 1 the engine. Per policy version the
trainer, before its filesystem publication, writes an announcement (`Announce`: version, tensor names,
shapes, dtypes) under `gen/G/announce/S`, sends the tensors one by one, and waits for the engine's
acknowledgement. The engine's receiver thread stages what it got by version; when the orchestrator's
`/update_weights` names that version, the server takes the staged tensors instead of reading the file
(the file is still committed, and still read whenever nothing was staged). Policy versions and the
in-flight update semantics are the engine's, unchanged.

Restarts: a restarted trainer takes a new generation, which the receiver sees and joins; a restarted
engine hosts a new store, on which the trainer's next send fails, reconnects and takes generation 1.
Every wait is bounded by `timeout_s`; a failed transfer costs that version the file read, never a hang.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from config.transport import WeightBroadcastConfig

log = logging.getLogger("rollflow.transport")
POLL_S = 0.02


@dataclass
class Announce:
    """What the trainer is about to send: policy `version`, then one tensor per name, in this order."""

    version: int
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Announce:
        return cls(**json.loads(data))


def _backend(cfg: WeightBroadcastConfig) -> str:
    if cfg.c10d_backend != "auto":
        return cfg.c10d_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _group(cfg: WeightBroadcastConfig, store, generation: int, rank: int):
    """The 2-rank group of one generation; construction is the rendezvous (bounded by timeout_s)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"gen/{generation}/pg", store)
    timeout = timedelta(seconds=cfg.timeout_s)
    if _backend(cfg) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def _device(cfg: WeightBroadcastConfig) -> str:
    return "cuda" if _backend(cfg) == "nccl" else "cpu"


class Sender:
    """The trainer's side (rank 0 only). `send` returns the seconds it took, or None when the transfer
    failed (the engine then reads the filesystem publication); it never raises and never blocks longer
    than about twice `timeout_s`."""

    def __init__(self, cfg: WeightBroadcastConfig):
        self.cfg = cfg
        self.store: Any = None
        self.pg: Any = None
        self.generation = self.seq = 0

    def _connect(self) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=self.cfg.timeout_s)
        self.store = dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False, timeout=timeout)
        self.generation, self.seq = int(self.store.add("generation", 1)), 0
        self.pg = _group(self.cfg, self.store, self.generation, rank=0)
        log.info(f"weight transport: joined the engine's group (generation {self.generation})")

    def _transfer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        assert self.store is not None and self.pg is not None
        names = sorted(state)
        ann = Announce(version, names, [list(state[n].shape) for n in names], [str(state[n].dtype) for n in names])
        self.seq += 1
        self.store.set(f"gen/{self.generation}/announce/{self.seq}", ann.encode().decode())
        device = _device(self.cfg)
        for i, name in enumerate(names):
            self.pg.send([state[name].detach().to(device).contiguous()], 1, i).wait()
        self.store.wait([f"gen/{self.generation}/ack/{self.seq}"], timedelta(seconds=self.cfg.timeout_s))

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
    """The engine's side: hosts the store, joins each new generation, receives announced versions in a
    thread and stages them. `take(version)` returns the staged state dict of that version (waiting while
    it is still arriving) or None."""

    def __init__(self, cfg: WeightBroadcastConfig, keep: int = 2):
        import torch.distributed as dist

        self.cfg, self.keep = cfg, keep
        timeout = timedelta(seconds=cfg.timeout_s)
        self.store = dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False, timeout=timeout)
        self._cv = threading.Condition()
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.receiving: int | None = None
        self._stop = threading.Event()
        self.stats = {"received": 0, "failed": 0, "generations": 0}
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
        return int(self.store.add("generation", 0))

    def _loop(self) -> None:
        joined = 0
        while not self._stop.is_set():
            generation = self._generation()
            if generation == joined:
                time.sleep(POLL_S)
                continue
            joined = generation
            try:
                self._serve(generation)
            except Exception as exc:  # the trainer went away or restarted: wait for its next generation
                self.stats["failed"] += 1
                log.warning(f"weight transport: generation {generation} ended: {exc}")
            finally:
                with self._cv:
                    self.receiving = None
                    self._cv.notify_all()

    def _serve(self, generation: int) -> None:
        pg = _group(self.cfg, self.store, generation, rank=1)
        self.stats["generations"] += 1
        log.info(f"weight transport: trainer joined (generation {generation})")
        seq = 0
        while not self._stop.is_set() and self._generation() == generation:
            key = f"gen/{generation}/announce/{seq + 1}"
            if not self.store.check([key]):
                time.sleep(POLL_S)
                continue
            seq += 1
            self._receive(pg, Announce.decode(self.store.get(key)))
            self.store.set(f"gen/{generation}/ack/{seq}", "1")

    def _receive(self, pg, ann: Announce) -> None:
        with self._cv:
            self.receiving = ann.version
        device = _device(self.cfg)
        state = {}
        for i, (name, shape, dtype) in enumerate(zip(ann.names, ann.shapes, ann.dtypes, strict=True)):
            buf = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
            pg.recv([buf], 0, i).wait()
            state[name] = buf.cpu() if device != "cpu" else buf
        with self._cv:
            self.staged[ann.version] = state
            for old in sorted(self.staged)[: -self.keep]:
                del self.staged[old]
            self.receiving = None
            self.stats["received"] += 1
            self._cv.notify_all()
