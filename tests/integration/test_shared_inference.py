"""A shared deployment's inference server (docs/multitenant.md) as a real `python -m engines.inference` process over
HTTP on 127.0.0.1: tenants join and leave by their record files in DEPLOY_DIR/tenants/, each is served its own
adapter (published by the real publisher into its own run directory) under its own token, updates touch only the
named tenant, and a tenant whose base is not the backbone is refused while the others serve.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from config.model import LoRAConfig, ModelConfig
from config.tenant import SharedConfig, SharedInferenceSettings
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from storage import weights
from storage.fs import get_fs
from storage.tenants import remove_tenant
from tests.inference_fixture import ADMIN, TenantRun, served_gap, serving, tenant_record, wait_health

MODEL = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_seq_len=1600)
TOK = CharTokenizer()
PROMPT = TOK.encode("rev:abcd=")


def _backbone(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(MODEL, TOK.vocab_size).eval()


def _generate(client: httpx.Client, model: str, auth: dict, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "return_token_ids": True, **extra}
    return client.post("/v1/completions", json=body, headers=auth)


def _assert_served_by(model: CausalLM, response: httpx.Response, version: int) -> None:
    """The answer's logprobs are those of the tenant's single-adapter model at that version (full forward); the
    engine-level parity is 1.9e-6 with other tenants in the batch (tests/unit/test_multitenant_engine.py)."""
    assert served_gap(model, response, version, PROMPT) <= 1e-5


@pytest.fixture
def deployment(tmp_path):
    """DEPLOY_DIR with its backbone publication, and a factory of tenant runs on that (or another) backbone."""
    deploy = str(tmp_path / "deploy")
    backbone = _backbone(0)
    fs, root = get_fs(deploy)
    weights.publish(fs, root, 0, backbone.publishable_state_dict())

    def tenant(name: str, cfg: LoRAConfig, base: CausalLM = backbone) -> TenantRun:
        return TenantRun(str(tmp_path / name), base, cfg)

    return deploy, tenant


def _shared(deploy: str, max_tenants: int) -> dict:
    shared = SharedConfig(max_tenants=max_tenants, max_lora_rank=8, poll_s=0.1)
    return {"shared": SharedInferenceSettings(deploy_dir=deploy, shared=shared)}


def test_tenants_are_served_their_own_adapters_under_their_own_tokens(deployment):
    deploy, tenant = deployment
    a, b = tenant("a", LoRAConfig(rank=4)), tenant("b", LoRAConfig(rank=8, target_modules=["q_proj", "v_proj"]))
    a1, b1 = a.publish(1, seed=1), b.publish(1, seed=2)
    auth_a, auth_b = tenant_record(deploy, "a", a), tenant_record(deploy, "b", b)
    with serving(deploy, MODEL, process=_shared(deploy, max_tenants=3)) as client:
        wait_health(client, lambda h: h["tenants"] == {"a": 1, "b": 1})
        _assert_served_by(a1, _generate(client, "a", auth_a), 1)
        _assert_served_by(b1, _generate(client, "b", auth_b), 1)
        assert _generate(client, "a", auth_a).json()["model"] == "a"
        assert _generate(client, "a", auth_b).status_code == 401  # another tenant's token
        assert _generate(client, "a", {"Authorization": "Bearer nope"}).status_code == 401
        assert _generate(client, "a", ADMIN).status_code == 401  # the admin token is no tenant's
        assert _generate(client, "zz", auth_a).status_code == 404
        assert client.post("/v1/completions", json={"prompt": PROMPT}, headers=auth_a).status_code == 404

        # an update names its tenant, with that tenant's token: only its version moves
        a2 = a.publish(2, seed=3)
        update = {"tenant": "a", "version": 2}
        assert client.post("/update_weights", json=update, headers=auth_b).status_code == 401
        assert client.post("/update_weights", json={"version": 2}, headers=ADMIN).status_code == 400
        assert client.post("/update_weights", json={"tenant": "a", "path": a.root}, headers=auth_a).status_code == 400
        r = client.post("/update_weights", json=update, headers=auth_a)
        assert r.status_code == 200 and r.json()["policy_version"] == 2
        assert client.get("/health").json()["tenants"] == {"a": 2, "b": 1}
        _assert_served_by(a2, _generate(client, "a", auth_a), 2)
        _assert_served_by(b1, _generate(client, "b", auth_b), 1)
        missing = client.post("/update_weights", json={"tenant": "a", "version": 9}, headers=auth_a)
        assert missing.status_code == 404

        # a tenant trained on another base is refused (and told why); the others serve on
        other = tenant("c", LoRAConfig(rank=4), base=_backbone(5))
        other.publish(1, seed=4)
        auth_c = tenant_record(deploy, "c", other)
        health = wait_health(client, lambda h: h["stats"]["tenants_refused"] == 1)
        assert health["tenants"] == {"a": 2, "b": 1}
        refused = _generate(client, "c", auth_c)
        assert refused.status_code == 403 and "model_sha256" in refused.json()["error"]["message"]
        _assert_served_by(b1, _generate(client, "b", auth_b), 1)


def _stream_until_error(client: httpx.Client, auth: dict, started: threading.Event, out: list) -> None:
    """A long streamed request of tenant a; `out` gets the error events its stream carried."""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=auth) as r:
        for line in r.iter_lines():
            started.set()
            if line.startswith("data: {") and '"error"' in line:
                out.append(json.loads(line[len("data: ") :])["error"])


def test_leaving_frees_the_slot_and_a_new_attempt_reloads(deployment):
    deploy, tenant = deployment
    a, b, c = (tenant(n, LoRAConfig(rank=r)) for n, r in (("a", 2), ("b", 4), ("c", 8)))
    a.publish(1, seed=1)
    b1 = b.publish(1, seed=2)
    c.publish(1, seed=3)
    auth_a, auth_b = tenant_record(deploy, "a", a), tenant_record(deploy, "b", b)
    with serving(deploy, MODEL, process=_shared(deploy, max_tenants=2)) as client:
        wait_health(client, lambda h: h["tenants"] == {"a": 1, "b": 1})
        auth_c = tenant_record(deploy, "c", c)  # one over max_tenants: refused until a slot frees
        wait_health(client, lambda h: h["stats"]["tenants_refused"] == 1)
        assert "max_tenants" in _generate(client, "c", auth_c).json()["error"]["message"]

        # tenant a leaves while its request runs: that request ends with an error, b's is untouched, c joins
        started, errors = threading.Event(), []
        streamer = threading.Thread(target=_stream_until_error, args=(client, auth_a, started, errors))
        streamer.start()
        assert started.wait(30)
        remove_tenant(deploy, "a")
        _assert_served_by(b1, _generate(client, "b", auth_b), 1)
        streamer.join(60)
        assert not streamer.is_alive() and [e["code"] for e in errors] == [410]
        wait_health(client, lambda h: h["tenants"] == {"b": 1, "c": 1} and h["stats"]["tenants_refused"] == 0)
        assert _generate(client, "a", auth_a).status_code == 404
        assert _generate(client, "c", auth_c).status_code == 200

        # a higher attempt of b (a resume) drops what was held and loads b's newest publication under its new token
        b3 = b.publish(3, seed=5)
        assert client.get("/health").json()["tenants"]["b"] == 1  # published, not yet asked for
        auth_b1 = tenant_record(deploy, "b", b, attempt=1)
        wait_health(client, lambda h: h["tenants"].get("b") == 3)
        assert _generate(client, "b", auth_b).status_code == 401  # the old attempt's token
        _assert_served_by(b3, _generate(client, "b", auth_b1), 3)
