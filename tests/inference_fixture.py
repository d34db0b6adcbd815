"""A real inference server (`python -m engines.inference`) on 127.0.0.1 for the tests that talk HTTP to it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch

from config.inference import InferenceConfig
from config.model import ModelConfig
from config.process import ComponentPaths, InferenceProcessConfig
from config.storage import StorageConfig
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from engines.protocol import ADMIN_TOKEN_ENV
from storage import weights
from storage.fs import get_fs

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
    root: str, model_cfg: ModelConfig, inference: dict | None = None, process: dict | None = None
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
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError("inference server did not become healthy")
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
