"""A real inference server (`python -m engines.inference`) on 127.0.0.1 for the tests that talk HTTP to it, and a shared
deployment's tenant runs (their adapter publications and records)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import torch

from config.inference import InferenceConfig
from config.model import LoRAConfig, ModelConfig
from config.process import ComponentPaths, InferenceProcessConfig
from config.storage import StorageConfig
from config.tenant import TenantRecord
from engines.models import lora
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from engines.protocol import ADMIN_TOKEN_ENV
from storage import weights
from storage.fs import get_fs
from storage.tenants import write_tenant

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def publish(root: str, model_cfg: ModelConfig, version: int, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(model_cfg, CharTokenizer().vocab_size).eval()
    fs, r = get_fs(root)
    weights.publish(fs, r, version, model.publishable_state_dict())
    return model


@contextmanager
def serving(
    root: str,
    model_cfg: ModelConfig,
    inference: dict | None = None,
    process: dict | None = None,
    start_timeout: float = 60,
) -> Iterator[httpx.Client]:
    """The server on the newest publication under `root` with these `[inference]` settings (a free port) and
    other InferenceProcessConfig fields (`process`, e.g. `shared`), until the block ends; a client with its base
    URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = InferenceProcessConfig(
        run=ComponentPaths(output_dir=root, run_id="t", storage=StorageConfig()),
        model=model_cfg,
        inference=InferenceConfig(**{**(inference or {}), "port": port}),
        seed=0,
        **(process or {}),
    )
    path = f"{root}/inference.json"
    with open(path, "w") as f:
        json.dump(cfg.model_dump(mode="json"), f)
    env = {**os.environ, ADMIN_TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "engines.inference", "--config", path], env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"inference server did not become healthy (exit code {proc.poll()})")
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------------
# A shared deployment's tenants (tests/integration/test_shared_inference.py, test_shared_vllm.py)


class TenantRun:
    """A tenant's run directory: version 0 is its copy of a backbone, later versions its adapter publications."""

    def __init__(self, root: str, backbone: CausalLM, cfg: LoRAConfig):
        self.root, self.cfg = root, cfg
        fs, r = get_fs(root)
        self.publisher = weights.Publisher(fs, r)
        self.publisher.publish(0, backbone.publishable_state_dict())
        self.model = copy.deepcopy(backbone)
        lora.attach_to(self.model, cfg)
        self.models: dict[int, CausalLM] = {0: copy.deepcopy(self.model)}

    def publish(self, version: int, seed: int) -> CausalLM:
        g = torch.Generator().manual_seed(seed)
        for m in lora.adapted_modules(self.model).values():
            m.lora_B.weight.data.normal_(0, 0.3, generator=g)
        lora.publish(self.publisher, self.model, self.cfg, version, {})
        self.models[version] = copy.deepcopy(self.model).eval()
        return self.models[version]


def tenant_record(deploy: str, name: str, run: TenantRun, attempt: int = 0) -> dict:
    """Attach the tenant run to the deployment (its record in DEPLOY_DIR/tenants/); its Authorization header."""
    token = f"token-of-{name}-{attempt}"
    sha = hashlib.sha256(token.encode()).hexdigest()
    write_tenant(deploy, TenantRecord(name=name, output_dir=run.root, attempt=attempt, run_id=name, token_sha256=sha))
    return {"Authorization": f"Bearer {token}"}


def wait_health(client: httpx.Client, ok: Callable[[dict], bool], timeout: float = 30) -> dict:
    """The server's /health once `ok` holds for it (polled every 0.1 s, at most `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        health = client.get("/health").json()
        if ok(health):
            return health
        assert time.monotonic() < deadline, f"timed out; last /health: {health}"
        time.sleep(0.1)


def served_gap(model, response, version: int, prompt: list[int]) -> float:
    """Largest |served logprob - `model`'s| over a completion's sampled tokens (a full forward of prompt + tokens),
    after checking the answer is 200 and came wholly from policy `version` (a shared server's tenant answers)."""
    import torch

    from engines.models.decoder import token_logprobs

    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["policy_version"] == choice["policy_version_end"] == version
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        expected = token_logprobs(model(ids)[:, :-1], ids[:, 1:], 1.0)[0, len(prompt) - 1 :]
    return float((expected - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max())
