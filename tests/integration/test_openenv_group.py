"""The OpenEnv adapter (engines/environments/openenv_env.py) in one process against real servers: the inference
server (tests/inference_fixture.py) and the OpenEnv copy game (tests/plugins/openenv/oe_echo.py) that the
adapter starts itself on 127.0.0.1. One group through the orchestrator's own `EpisodeGroup`: the rows hold the
inference server's token ids and logprobs exactly, the mask is 1 on exactly them, and closing the environment
stops the OpenEnv server."""

from __future__ import annotations

import asyncio
import random
from difflib import SequenceMatcher

import httpx
import numpy as np
import pytest
from conftest import ROOT

from config.envs import EnvSpec
from config.model import ModelConfig
from config.orchestrator import OrchestratorConfig
from engines.environments import plugins
from engines.models.tokenizer import CharTokenizer
from engines.orchestrator.multiturn import EpisodeGroup
from tests.inference_fixture import publish, serving

pytestmark = pytest.mark.slow
MODEL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=64)
ROUNDS, GROUP = 3, 4


class Recording(EpisodeGroup):
    """The orchestrator's group, keeping each request and the server's choice as received (the audit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, list[int], object]] = []

    async def sample(self, request, session_id):
        choice = await super().sample(request, session_id)
        self.calls.append((session_id, list(request.prompt), choice))
        return choice


async def _group(root: str, env) -> tuple[list, Recording]:
    """Both servers start concurrently (each spends seconds importing), then one group runs."""
    ocfg = OrchestratorConfig(batch_size=1, group_size=GROUP, max_new_tokens=6, temperature=1.0)
    inference = serving(root, MODEL)
    try:
        sync_client, _ = await asyncio.gather(asyncio.to_thread(inference.__enter__), env.start())
        async with httpx.AsyncClient(base_url=str(sync_client.base_url), timeout=60) as client:
            group = Recording(client, asyncio.Semaphore(8), CharTokenizer(), ocfg, 0, MODEL.max_seq_len)
            rows = await env.run_group(group, env.sample(random.Random(7)), "run", 1, 0)
    finally:
        await env.close()
        inference.__exit__(None, None, None)
    return rows, group


def test_a_group_of_openenv_episodes_holds_the_servers_tokens(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests/plugins/openenv"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests/plugins/openenv'}:{ROOT}")  # the OpenEnv server's import path
    args = {"app": "oe_echo:app", "max_sessions": GROUP, "reset_args": {"rounds": ROUNDS}, "log_dir": str(tmp_path)}
    env = plugins.build(EnvSpec(id="openenv", args=args))
    publish(str(tmp_path), MODEL, 0, seed=1)
    rows, group = asyncio.run(_group(str(tmp_path), env))
    assert env.server.proc is None  # stopped by close()
    tok, calls = CharTokenizer(), {}
    for session, prompt, choice in group.calls:
        calls.setdefault(session, []).append((prompt, choice))
    assert len(rows) == GROUP and {f"run/{r.sample_id}" for r in rows} == set(calls)
    for r in rows:
        ids, mask = r.completion_ids, r.completion_mask
        turns = calls[f"run/{r.sample_id}"]
        model_ids = [t for t, m in zip(ids, mask, strict=True) if m]
        assert (
            np.array(model_ids, np.int32).tobytes()
            == np.array([t for _, c in turns for t in c.token_ids]).astype(np.int32).tobytes()
        )
        served_lps = [lp for _, c in turns for lp in c.logprobs.token_logprobs]
        assert [lp for lp, m in zip(r.completion_logprobs, mask, strict=True) if m] == served_lps
        assert all(prompt == r.prompt_ids + ids[: len(prompt) - len(r.prompt_ids)] for prompt, _ in turns)
        env_text = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m], skip_special=False)
        words = [r.prompt_text[4:]] + [w.removesuffix("=") for w in env_text.split("say:")[1:]]
        expected = sum(SequenceMatcher(None, c.text, w).ratio() for (_, c), w in zip(turns, words, strict=False))
        assert r.reward == pytest.approx(expected / ROUNDS, abs=1e-6)
    assert len({r.prompt_text for r in rows}) == 1  # one task: every episode reset with the same seed
