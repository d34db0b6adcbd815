"""Inference backends as an extension point: a backend package outside rollflow (tests/plugins/pkg/echobackend)
registered by a real entry point (a dist-info on the path, read by importlib.metadata) and accepted or
refused by the real CLI at load from its declared capabilities; rollflow's own registrations; the
declarations import no heavy module; and the front end's in-flight bound and disconnect handling, served
over real HTTP on 127.0.0.1 in this process (tests/integration/test_inference_plugin.py runs the backend in
a real `python -m engines.inference` process)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from config.registry import INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS, registered

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tests" / "plugins" / "pkg"
TINY = ROOT / "profiles" / "tiny-cpu.toml"


def write_site(d: Path) -> Path:
    """What `pip install echobackend` would leave: its dist-info with the entry point."""
    info = d / "echobackend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echobackend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{INFERENCE_BACKEND_GROUP}]\necho = echobackend:BACKEND\n")
    return d


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return write_site(tmp_path_factory.mktemp("site"))


def rollflow(site: Path, *args: str) -> subprocess.CompletedProcess:
    """The real CLI in its own process, with the plugin installed (on its path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PKG), str(ROOT)])}
    argv = [sys.executable, "-m", "rollflow.cli", *args]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_cli_accepts_a_registered_backend_and_writes_it_to_the_inference_config(site, tmp_path):
    out = tmp_path / "run"
    r = rollflow(site, "rl", "@", str(TINY), "--inference.backend", "echo", "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    stored = json.loads((out / "config" / "inference.json").read_text())
    assert stored["inference"]["backend"] == "echo"
    assert not (out / "config" / "vllm-plan.json").exists()  # no launch plan declared, none written


def test_the_cli_refuses_an_unregistered_backend_listing_the_registered_ones(site, tmp_path):
    out = str(tmp_path / "run")
    r = rollflow(site, "rl", "@", str(TINY), "--inference.backend", "echoo", "--dry-run", "--output-dir", out)
    assert r.returncode == 2
    assert "unknown inference backend 'echoo'; registered: echo, embedded, vllm" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_cli_refuses_at_load_each_capability_the_backend_lacks(site, tmp_path):
    out = tmp_path / "run"
    wants = ["--weight-broadcast.type", "collective", "--inference.num-infer-replicas", "2",
             "--inference.enable-return-routed-experts", "true", "--inference.router.policy", "round_robin",
             "--inference.backend", "echo", "--dry-run", "--output-dir", str(out)]  # fmt: skip
    r = rollflow(site, "rl", "@", str(TINY), *wants)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "inference.backend = 'echo' does not run it" in line]
    assert len(lines) == 4, r.stderr
    expected = {
        "inference.num_infer_replicas (or deployment.num_infer_replicas) = 2": "vllm",
        'weight_broadcast.type = "collective"': "embedded",
        "inference.enable_return_routed_experts": "embedded, vllm",
        "inference.router is a deployment key": "vllm",
    }
    for key, able in expected.items():
        assert any(line.strip().startswith(key) and f"backends that do: {able})" in line for line in lines), key
    assert not out.exists()  # refused before anything was written


def test_rollflows_backends_are_registered_in_the_entry_point_group_too():
    """pyproject.toml registers the built-in backends in the group; config/registry.py repeats them."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][INFERENCE_BACKEND_GROUP]
    assert declared == INFERENCE_BACKENDS
    assert set(INFERENCE_BACKENDS) <= set(registered(INFERENCE_BACKEND_GROUP, INFERENCE_BACKENDS))


def test_backend_declarations_import_no_heavy_module(site):
    """The CLI loads a declaration at load time: it must not pull torch or the HTTP stack in."""
    code = (
        "import sys\n"
        "from engines.inference.backend import spec\n"
        "for name in ('embedded', 'vllm', 'echo'): spec(name)\n"
        "print([m for m in ('torch', 'fastapi', 'uvicorn', 'httpx', 'numpy') if m in sys.modules])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PKG), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_registered_object_that_is_not_a_backend_spec_is_refused_by_name():
    from engines.inference.backend import spec
    from engines.registry import PluginError

    with pytest.raises(PluginError, match="names a dict, not an engines.inference.backend.BackendSpec"):
        spec("config.registry:INFERENCE_BACKENDS")


# --- the front end over the echo backend, in this process ---------------------------------------------------


class Served:
    """`build_app(backend, settings)` under uvicorn on 127.0.0.1 in a thread, for one test."""

    def __init__(self, backend, settings):
        import uvicorn

        from engines.inference.frontend import build_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(build_app(backend, settings), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the front end did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.syspath_prepend(str(PKG))
    from echobackend.backend import EchoBackend

    yield EchoBackend
    for name in [m for m in sys.modules if m == "echobackend" or m.startswith("echobackend.")]:
        del sys.modules[name]


def test_requests_over_the_in_flight_bound_fail_alone_with_429(echo):
    """max_in_flight = 2: of four slow requests at once, two are served and two refused at once; the
    server serves again afterwards."""
    from engines.inference.frontend import Settings

    served = Served(echo("rollflow/t", 4096, delay_s=0.05), Settings("token", max_in_flight=2))
    try:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as c:
                body = {"prompt": "abc", "max_tokens": 20}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200, 200, 429, 429]
        refused = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error" and "max_queued_requests" in refused.text
        assert httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        served.close()


def test_a_client_that_leaves_cancels_its_work_in_the_backend(echo):
    """A non-streamed request whose client stops waiting, and a stream closed after its first chunk, are
    cancelled in the backend (its `aborted` count), within a few disconnect polls."""
    from engines.inference.frontend import Settings

    backend = echo("rollflow/t", 4096, delay_s=0.01)
    served = Served(backend, Settings("token"))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2000}, timeout=0.3)
        wait_for(lambda: backend.stats["aborted"] == 1)
        body = {"prompt": "ab", "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: {")
        wait_for(lambda: backend.stats["aborted"] == 2)
    finally:
        served.close()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_vision_language_model_is_refused_at_load_by_a_backend_that_serves_no_images(tmp_path):
    """The load-time check names the reason the vLLM backend takes no images (measured, engines/inference/vllm)
    and the backends that do; the vLLM backend's start refuses a VLM directory with the same reason."""
    from config.inference import InferenceConfig
    from config.transport import WeightBroadcastConfig
    from engines.inference.backend import VISION_NEED, check
    from engines.inference.vllm import NO_VISION
    from engines.inference.vllm.backend import refuse_vision
    from engines.registry import PluginError

    check(InferenceConfig(backend="embedded"), WeightBroadcastConfig(), vision=True)
    check(InferenceConfig(backend="vllm"), WeightBroadcastConfig(), vision=False)
    with pytest.raises(PluginError) as refused:
        check(InferenceConfig(backend="vllm"), WeightBroadcastConfig(), vision=True)
    message = str(refused.value)
    assert f"{VISION_NEED}: inference.backend = 'vllm' does not run it ({NO_VISION})" in message
    assert message.endswith("(registered backends that do: embedded)")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {"depth": 2}}))
    with pytest.raises(SystemExit, match="is a vision-language model: the vLLM backend forwards no images"):
        refuse_vision(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    refuse_vision(tmp_path)  # a text model starts
