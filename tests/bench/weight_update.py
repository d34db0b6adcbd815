"""Benchmark 3: weight update. From the trainer's optimizer step to the engine serving the new policy,
against the raw time to write and read the same bytes on the same filesystem; and the engine's pause.
Each model size runs with both transports (`weight_broadcast.type`): filesystem, and collective (the
tensors over the trainer-engine gloo group, the publication still written) in the same run.

A real inference server process serves a run directory; this process plays the trainer (optimizer step,
`weights.publish`) and the orchestrator's weight follower (`POST /update_weights`), as the run does.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

from tests.bench.harness import QUICK, Stats, Workspace, bench_config, ratio_stats, repeats, table

TITLE = "3. Weight update"
SIZES = {  # name -> model overrides; "tiny" is the benchmark workload's model
    "tiny": {},
    "wide": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 1536},
}


def _raw_write_read(directory: Path, data: bytes) -> float:
    """Baseline: the same bytes written (with fsync, as the commit does) and read back, plain file calls."""
    path = directory / f"raw-{os.getpid()}.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        f.read()
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


class Server:
    """The inference server as the flow starts it, on `out`, stopped on exit."""

    def __init__(self, out: Path, cfg):
        from runtime.rundir import free_port, new_run_id, write_configs

        cfg.inference.port = free_port(cfg.inference.host)
        if cfg.weight_broadcast.type == "collective":
            cfg.weight_broadcast.port = free_port(cfg.weight_broadcast.host)
        self.url = f"http://{cfg.inference.host}:{cfg.inference.port}"
        self.urls = write_configs(cfg, new_run_id(cfg), self.url)
        self.token = os.urandom(16).hex()
        self.secret = os.urandom(32).hex()  # the collective transport's, as the flow draws it per attempt
        self.stop = threading.Event()
        self.out = out

    def __enter__(self):
        import httpx

        from config.transport import TRANSPORT_SECRET_ENV
        from engines.protocol import ADMIN_TOKEN_ENV
        from runtime.process import supervise

        argv = [sys.executable, "-m", "engines.inference", "--config", self.urls["inference"]]
        env = {ADMIN_TOKEN_ENV: self.token, TRANSPORT_SECRET_ENV: self.secret}
        log = str(self.out / "logs" / "inference.log")
        self.thread = threading.Thread(target=supervise, args=("inference", argv, env, lambda _: None, self.stop, log))
        self.thread.start()
        self.client = httpx.Client(base_url=self.url, timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("inference server did not come up")

    def update(self, version: int) -> dict:
        r = self.client.post(
            "/update_weights", json={"version": version}, headers={"Authorization": f"Bearer {self.token}"}
        )
        r.raise_for_status()
        return r.json()

    def __exit__(self, *exc):
        self.client.close()
        self.stop.set()
        self.thread.join()


def measure_size(root: Path, model_overrides: dict, n: int, transport: str = "filesystem") -> dict:
    import torch

    from config.transport import TRANSPORT_SECRET_ENV
    from engines.models.decoder import CausalLM
    from engines.models.tokenizer import CharTokenizer
    from engines.weight_transport import Sender, transport_key
    from storage import weights
    from storage.fs import get_fs

    out = root / "weights-bench"
    shutil.rmtree(out, ignore_errors=True)
    cfg = bench_config(out)
    cfg.model = cfg.model.model_copy(update=model_overrides)
    cfg.weight_broadcast.type = transport  # type: ignore[assignment]
    torch.set_num_threads(1)
    tok = CharTokenizer()
    model = CausalLM(cfg.model, tok.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fs, froot = get_fs(str(out))
    weights.publish(fs, froot, 0, model.publishable_state_dict())
    ids = torch.randint(4, tok.vocab_size, (8, 32))
    m: dict[str, list[float]] = {k: [] for k in ("send", "publish", "load", "apply", "http", "total", "raw")}
    with Server(out, cfg) as server:
        key = transport_key({TRANSPORT_SECRET_ENV: server.secret})
        sender = Sender(cfg.weight_broadcast, key) if transport == "collective" else None
        for version in range(1, n + 1):
            model(ids).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()  # the optimizer step has returned: the clock starts
            sent = sender.send(version, model.publishable_state_dict()) if sender else 0.0  # as the trainer does
            assert sent is not None, "collective transfer failed"
            t_pub = time.perf_counter()
            directory = weights.publish(fs, froot, version, model.publishable_state_dict())
            t1 = time.perf_counter()
            resp = server.update(version)  # what the orchestrator's follower sends on seeing the manifest
            t2 = time.perf_counter()
            assert resp["policy_version"] == version and resp["source"] == transport, resp
            m["send"].append(sent)
            m["publish"].append(t1 - t_pub)
            m["load"].append(resp["load_s"])
            m["apply"].append(resp["apply_s"])
            m["http"].append((t2 - t1) - resp["load_s"] - resp["apply_s"])
            m["total"].append(t2 - t0)
            nbytes = (Path(directory) / weights.WEIGHTS_FILE).stat().st_size
            m["raw"].append(_raw_write_read(out, os.urandom(nbytes)))
    m["label"] = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB"
    return m


def report(results: dict[str, dict], poll_s: float) -> str:
    rows = []
    for name, m in results.items():
        rows.append(
            [
                f"{name} ({m['label']})",
                Stats(m["total"]).fmt(unit=" s"),
                Stats(m["raw"]).fmt(unit=" s"),
                ratio_stats(m["total"], m["raw"]).fmt() + "x",
                Stats(m["send"]).fmt(unit=" s"),
                Stats(m["publish"]).fmt(unit=" s"),
                Stats(m["load"]).fmt(unit=" s"),
                Stats(m["http"]).fmt(unit=" s"),
                Stats(m["apply"]).fmt(unit=" s"),
            ]
        )
    headers = [
        "model",
        "optimizer step -> serving",
        "raw write+read (baseline)",
        "ratio",
        "collective send",
        "publish",
        "server load + verify",
        "HTTP + JSON",
        "engine pause (apply)",
    ]
    return (
        table(headers, rows)
        + f"\n\nNot included above: the orchestrator notices a publication by polling `weights/` every "
        f"`orchestrator.poll_interval_s` = {poll_s} s, which adds {poll_s / 2:.3f} s on average."
    )


DEFINITIONS = """\
Clock starts when `optimizer.step()` returns and stops when `POST /update_weights` answers that the
engine serves the new version. publish = `weights.publish` (safetensors serialization, sha256, write +
fsync + rename, manifest). server load + verify = the server reading the manifest and file, checking
size and sha256, deserializing. engine pause = the server's `apply_s`: the engine's worker swapping the
weights in (`load_state_dict`), the only part during which no decode step can run; the engine is idle
here, so this is the swap itself, not a wait for a decode step. Baseline: `os.urandom` bytes of the
same size written with fsync and read back in the same directory with plain file calls. collective
send = the trainer-side `Sender.send` (announce, tensor-by-tensor gloo sends, the engine's acknowledgement),
before the publication; with it the server takes the received tensors instead of loading the file
(its "load" is then the wait for them plus the manifest check).
"""


def run(ws: Workspace) -> str:
    n = repeats(5)
    results = {
        f"{name}, {transport}": measure_size(ws.root, overrides, n, transport)
        for name, overrides in (list(SIZES.items())[:1] if QUICK else SIZES.items())
        for transport in ("filesystem", "collective")
    }
    poll = bench_config(ws.root / "x").orchestrator.poll_interval_s
    return DEFINITIONS + "\n" + report(results, poll)
