"""A shared deployment's server on the vLLM backend (engines/inference/vllm/shared.py) as a real `python -m
engines.inference` process over a real vLLM CPU server with --enable-lora: two tenants' adapters (published by the
real publisher into their own run directories, different ranks and targets) are served in the same minutes, each
token's logprob equal to rollflow's single-adapter model's (the embedded engine's LoRALinear) within the tolerance
the vLLM-vs-rollflow tests use; an update of one tenant leaves the other's answers unchanged; the gate answers as
the embedded shared server's (tests/integration/test_shared_inference.py).

Needs the vLLM environment (infra/vllm/setup.sh); skipped with that reason when it is absent. vLLM on CPU takes a
minute or more to start, so one server serves the whole scenario.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from config.model import LoRAConfig
from config.tenant import SharedConfig, SharedInferenceSettings
from engines.models.tokenizer import CharTokenizer
from storage.tenants import remove_tenant
from tests.inference_fixture import ADMIN, TenantRun, served_gap, serving, tenant_record, wait_health
from tests.vllm_fixture import publish_hf, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
PROMPT = CharTokenizer().encode("abc:")
GAP = 1e-5  # tests/integration/test_vllm_backend.py: fp32 on both sides, different kernels


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(client: httpx.Client, model: str | None, auth: dict, seed: int = 1) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed, "logprobs": 0}
    body |= {"return_token_ids": True} | ({"model": model} if model else {})
    return client.post("/v1/completions", json=body, headers=auth, timeout=300)


@pytest.fixture
def deployment(tmp_path):
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("no vLLM environment at .venv-vllm: run infra/vllm/setup.sh (~10 min, 3.5 GB)")
    loaded, mc = tiny_model()
    deploy = str(tmp_path / "deploy")
    publish_hf(Path(deploy), 0, loaded)  # the backbone, a Hugging Face directory vLLM loads
    return deploy, loaded.model.eval(), mc


def test_vllm_serves_each_tenant_its_own_adapter_and_updates_one_alone(deployment, tmp_path):
    deploy, backbone, mc = deployment
    a = TenantRun(str(tmp_path / "a"), backbone, LoRAConfig(rank=4))
    b = TenantRun(str(tmp_path / "b"), backbone, LoRAConfig(rank=8, target_modules=["q_proj", "v_proj"]))
    a1, b1 = a.publish(1, seed=1), b.publish(1, seed=2)
    auth_a, auth_b = tenant_record(deploy, "a", a), tenant_record(deploy, "b", b)
    inference = {"backend": "vllm", "deployment": {"type": "single_node", "backend_port": _free_port()}}
    inference["vllm_extra"] = {"enforce_eager": True}  # no torch.compile warm-up on a busy CPU
    shared = SharedInferenceSettings(deploy_dir=deploy, shared=SharedConfig(max_tenants=3, max_lora_rank=8, poll_s=0.2))
    t0 = time.monotonic()
    with serving(deploy, mc, inference, {"shared": shared}, start_timeout=900) as client:
        print(f"shared vLLM server ready in {time.monotonic() - t0:.1f} s")
        wait_health(client, lambda h: h["tenants"] == {"a": 1, "b": 1}, timeout=60)

        # both tenants at once: requests in flight together, each on its own adapter
        with ThreadPoolExecutor(4) as pool:
            jobs = [(m, v, pool.submit(_generate, client, n, auth, s)) for s in (1, 2) for n, m, v, auth in
                    (("a", a1, 1, auth_a), ("b", b1, 1, auth_b))]  # fmt: skip
            gaps = [served_gap(m, job.result(), v, PROMPT) for m, v, job in jobs]
        print(f"vLLM vs rollflow's single-adapter model, two tenants: largest logprob gap {max(gaps):.1e}")
        assert max(gaps) < GAP
        # the adapters matter: the backbone alone gives other logprobs
        assert served_gap(a.models[0], _generate(client, "a", auth_a), 1, PROMPT) > 100 * GAP
        assert _generate(client, "a", auth_a).json()["model"] == "a"

        # the gate: the embedded shared server's answers
        assert _generate(client, "a", auth_b).status_code == 401  # another tenant's token
        assert _generate(client, "a", {"Authorization": "Bearer nope"}).status_code == 401
        assert _generate(client, "a", ADMIN).status_code == 401  # the admin token is no tenant's
        assert _generate(client, "zz", auth_a).status_code == 404
        assert _generate(client, None, auth_a).status_code == 404

        # an update of tenant a: b's answers stay exactly what they were
        before = _generate(client, "b", auth_b, seed=5).json()["choices"][0]
        a2 = a.publish(2, seed=3)
        update = {"tenant": "a", "version": 2}
        assert client.post("/update_weights", json=update, headers=auth_b).status_code == 401
        assert client.post("/update_weights", json={"tenant": "a", "path": a.root}, headers=auth_a).status_code == 400
        t1 = time.monotonic()
        r = client.post("/update_weights", json=update, headers=auth_a, timeout=300)
        assert r.status_code == 200 and r.json()["policy_version"] == 2, r.text
        print(f"tenant update (load_lora_adapter, switch, unload) took {time.monotonic() - t1:.2f} s")
        health = client.get("/health").json()
        assert health["tenants"] == {"a": 2, "b": 1}
        assert health["stats"]["lora_adapters"] == 2  # a's version 1 was unloaded after the switch
        gap2 = served_gap(a2, _generate(client, "a", auth_a), 2, PROMPT)
        after = _generate(client, "b", auth_b, seed=5).json()["choices"][0]
        print(f"after a's update: a's gap {gap2:.1e}; b's answer unchanged: {after == before}")
        assert gap2 < GAP
        assert after["token_ids"] == before["token_ids"] and after["logprobs"] == before["logprobs"]
        assert served_gap(b1, _generate(client, "b", auth_b), 1, PROMPT) < GAP
        assert client.post("/update_weights", json={"tenant": "a", "version": 9}, headers=auth_a).status_code == 404
        assert client.post("/update_weights", json={"tenant": "a", "version": 1}, headers=auth_a).status_code == 409

        # b leaves: its record goes, a serves on
        remove_tenant(deploy, "b")
        wait_health(client, lambda h: h["tenants"] == {"a": 2} and h["stats"]["lora_adapters"] == 1, timeout=30)
        assert _generate(client, "b", auth_b).status_code == 404
        assert served_gap(a2, _generate(client, "a", auth_a), 2, PROMPT) < GAP
