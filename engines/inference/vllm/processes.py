"""The vLLM processes of a local run: the publication as a model directory, the servers and routers, their end.

Runs in rollflow's environment and starts vLLM from its own (`inference.vllm.python`, built by
infra/vllm/setup.sh). Data flow:
  a committed publication --materialize--> a local Hugging Face directory (config.json, tokenizer,
  model.safetensors; verified, a delta rebuilt) --launch/vllm.py render--> vLLM servers (+ a vllm-router per
  replica) on this host, bound to 127.0.0.1 unless inference.host says otherwise --> the vLLM backend
  (backend.py) in front of them. Several replicas on one host: `inference.deployment.type = "multi_node"` with
  every node 127.0.0.1 (num_nodes servers behind one router) and/or `inference.num_infer_replicas` copies of the
  shape (the backend spreads sessions over their routers).
Every vLLM process's output reaches this process's log, each line prefixed with the process's name; each
dies with this process. Multi-node, disaggregated and mooncake shapes run under Slurm only; here
`--dry-run` renders them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
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

from config.cpus import CPUS_ENV, format_cpu_list, parse_cpu_list, split
from config.inference import InferenceConfig
from config.redact import MissingReference, resolve_env
from config.vllm import DisaggregatedDeployment, MultiNodeDeployment
from launch import vllm as vllm_launch
from storage.fs import check_name, not_private, step_number

log = logging.getLogger("rollflow.inference.vllm")
ROOT = Path(__file__).resolve().parents[3]  # the checkout: inference.vllm.python is relative to it
WORKER_DIR = Path(__file__).resolve().parent / "worker"
KEEP_MATERIALIZED = 2  # the served version and the one being loaded


OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU: the cores of a server's OpenMP threads
RECORD = ".rollflow-materialized.json"  # in a materialized directory: what it was built from, each file's sha256


def cache_dir(run_id: str) -> Path:
    """This user's private materialization cache for run `run_id`: `<tmp>/rollflow-vllm-<uid>/<run_id>`, created
    mode 0700. The system temp directory is shared: a folder there that is not a real directory owned by this
    user and closed to others (another user may have made it first) is not used; a fresh private one is."""
    check_name(run_id, "the run id")
    if "/" in run_id:
        raise ValueError(f"run id {run_id!r}: one path component expected")
    top = Path(tempfile.gettempdir()) / f"rollflow-vllm-{os.getuid()}"
    for d in (top, top / run_id):
        d.mkdir(mode=0o700, exist_ok=True)
        if (problem := not_private(d)) is not None:
            fresh = Path(tempfile.mkdtemp(prefix=f"rollflow-vllm-{run_id}-"))
            log.warning(f"{d} is {problem}: not trusted; materializing into {fresh} instead")
            return fresh
    return top / run_id


def materialize(fs, root: str, version: int, cache: Path) -> Path:
    """Publication `version` as a local HF directory under `cache` (atomic: built aside, then renamed). A
    directory already there is used only if it matches the publication's current manifest (`_matches`)."""
    from safetensors.torch import save_file

    from storage import weights
    from storage.fs import local_path, read_manifest, read_verified

    directory = weights.version_dir(root, version)
    dest = cache / f"step={version}"
    manifest = read_manifest(fs, directory)
    if dest.exists():
        if _matches(dest, manifest):
            return dest
        log.warning(f"{dest} does not match {directory}'s manifest: materializing it again")
        shutil.rmtree(dest)
    if "config.json" not in manifest["files"]:
        raise FileNotFoundError(f"{directory} has no config.json: vLLM serves Hugging Face publications only")
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    where = f"{directory}/_manifest.json"
    for name in manifest["files"]:
        if name not in (weights.WEIGHTS_FILE, weights.DELTA_FILE):
            target = Path(local_path(tmp, name, where))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(read_verified(fs, directory, name, manifest))
    save_file(weights.load(fs, directory), str(tmp / weights.WEIGHTS_FILE), metadata={"format": "pt"})
    _record(tmp, manifest)
    tmp.rename(dest)
    numbered = [(n, p) for p in cache.glob("step=*") if (n := step_number(p.name, str(cache))) is not None]
    for _, old in sorted(numbered)[:-KEEP_MATERIALIZED]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def _files(d: Path) -> dict[str, str]:
    """Relative name -> sha256 of every file under `d` but the record."""
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != RECORD
    }


def _record(d: Path, manifest: dict) -> None:
    from storage.fs import MANIFEST_CHECKSUM

    record = {"manifest_sha256": manifest.get(MANIFEST_CHECKSUM), "files": _files(d)}
    (d / RECORD).write_text(json.dumps(record))


def _matches(dest: Path, manifest: dict) -> bool:
    """Whether `dest` was materialized from this manifest and holds exactly what was written then: the record
    names the manifest's checksum, the files kept from the publication match their manifest entries, and the
    weights file matches the sha256 recorded when it was written."""
    from storage.fs import MANIFEST_CHECKSUM
    from storage.weights import DELTA_FILE, WEIGHTS_FILE

    try:
        record = json.loads((dest / RECORD).read_text())
        files = _files(dest)
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("manifest_sha256") != manifest.get(MANIFEST_CHECKSUM):
        return False
    kept = {n: e["sha256"] for n, e in manifest["files"].items() if n not in (WEIGHTS_FILE, DELTA_FILE)}
    if files != record.get("files") or files.keys() != {*kept, WEIGHTS_FILE}:
        return False
    return all(files[n] == sha for n, sha in kept.items())


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
    # A SIGKILLed inference process must not leave vLLM running: the kernel sends SIGTERM when the parent dies.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _relay(name: str, stream) -> None:
    """Copy a process's output to ours line by line, prefixed with its name (whose log a line is)."""
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(f"[{name}] ".encode() + line)
        sys.stdout.buffer.flush()


def new_token() -> str:
    """The attempt's secret for vLLM's routes (launch/vllm.py AUTH_MIDDLEWARE): only the proxy sends it."""
    return secrets.token_urlsafe(32)


def process_env(p: vllm_launch.Process, token: str) -> dict[str, str]:
    """What a process runs with: ours, its rendered environment with every "${NAME}" resolved from ours (at
    launch only: configs, plans and logs keep the reference), and the attempt's secret (servers only)."""
    try:
        env = {**os.environ, **resolve_env(p.env, os.environ, where=f"the environment of {p.name}")}
    except MissingReference as exc:
        raise SystemExit(str(exc.args[0])) from None
    if _is_server(p):
        env[vllm_launch.TOKEN_ENV] = token
    return env


def _is_server(p: vllm_launch.Process) -> bool:
    return p.argv[1:3] == ["-m", vllm_launch.API_SERVER]


def core_shares(processes: list[vllm_launch.Process]) -> dict[str, dict[str, str]]:
    """When this server is bound to cores (ROLLFLOW_CPUS, config/cpus.py), each local vLLM server's OpenMP
    threads get their own share of them (VLLM_CPU_OMP_THREADS_BIND), unless its environment names its own."""
    text = os.environ.get(CPUS_ENV)
    servers = [p for p in processes if _is_server(p) and OMP_BIND_ENV not in p.env]
    if not text or not servers:
        return {}
    shares = split(parse_cpu_list(text), len(servers))
    return {p.name: {OMP_BIND_ENV: format_cpu_list(c)} for p, c in zip(servers, shares, strict=True)}


def launch(replicas: list[vllm_launch.Replica], token: str) -> list[subprocess.Popen]:
    """Start every process of `replicas`; each vLLM server answers only requests that carry `token`."""
    procs = []
    processes = [p for r in replicas for p in r.processes]
    cores = core_shares(processes)
    for p in processes:
        log.info(f"starting {p.name}: {p.shell()}")  # secrets as references or masked (Process.shell)
        if p.name in cores:
            log.info(f"{p.name}: OpenMP threads on CPU(s) {cores[p.name][OMP_BIND_ENV]}")
        proc = subprocess.Popen(
            p.argv,
            env=process_env(p, token) | cores.get(p.name, {}),
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
