"""The OpenEnv adapter (engines/environments/openenv_env.py) in one process against real servers: the inference
server (tests/inference_fixture.py) and an OpenEnv app (tests/plugins/openenv) that the adapter starts itself on
127.0.0.1. One group through the orchestrator's own `EpisodeGroup`: the rows hold the inference server's token
ids and logprobs exactly, the mask is 1 on exactly them, the tokens between turns are the observations (or the
MCP tools' results), the rewards are the game's, and closing the environment stops the OpenEnv server."""

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

# `long`: each test starts both servers and plays a group, 35-95 s on the shared 2-core machine at load 12-16
# (about 10 s of CPU), over the default suite's budget; tests/unit/test_openenv_env.py is the default suite's part.
pytestmark = [pytest.mark.slow, pytest.mark.long]
OE_ENVS = ROOT / "tests/plugins/openenv"
MODEL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=64)
GROUP = 4


class Recording(EpisodeGroup):
    """The orchestrator's group, keeping each request and the server's choice as received (the audit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: dict[str, list] = {}

    async def sample(self, request, session_id):
        choice = await super().sample(request, session_id)
        self.calls.setdefault(session_id, []).append((list(request.prompt), choice))
        return choice


async def _group(root: str, env, task) -> tuple[list, Recording]:
    """Both servers start concurrently (each spends seconds importing), then one group runs."""
    ocfg = OrchestratorConfig(batch_size=1, group_size=GROUP, max_new_tokens=6, temperature=1.0)
    inference = serving(root, MODEL)
    try:
        sync_client, _ = await asyncio.gather(asyncio.to_thread(inference.__enter__), env.start())
        async with httpx.AsyncClient(base_url=str(sync_client.base_url), timeout=60) as client:
            group = Recording(client, asyncio.Semaphore(8), CharTokenizer(), ocfg, 0, MODEL.max_seq_len)
            rows = await env.run_group(group, task, "run", 1, 0)
    finally:
        await env.close()
        inference.__exit__(None, None, None)
    return rows, group


def _play(tmp_path, monkeypatch, args: dict):
    """One group of the env `args` describe: (env, task, rows, {sample_id: [(request ids, choice)]})."""
    monkeypatch.syspath_prepend(str(OE_ENVS))
    monkeypatch.setenv("PYTHONPATH", f"{OE_ENVS}:{ROOT}")  # the OpenEnv server's import path
    env = plugins.build(EnvSpec(id="openenv", args={**args, "max_sessions": GROUP, "log_dir": str(tmp_path)}))
    task = env.sample(random.Random(7))
    publish(str(tmp_path), MODEL, 0, seed=1)
    rows, group = asyncio.run(_group(str(tmp_path), env, task))
    assert env.server.proc is None  # stopped by close()
    log = env.server.log.read_text()
    assert "Traceback" not in log, log[-2000:]  # sessions end with a closing handshake, not a logged error each
    assert len(rows) == GROUP and {f"run/{r.sample_id}" for r in rows} == set(group.calls)
    return env, task, rows, {r.sample_id: group.calls[f"run/{r.sample_id}"] for r in rows}


def _assert_the_servers_tokens(r, turns) -> list[str]:
    """The model tokens are the inference server's, byte for byte; each request was the row's context up to
    it; returns the text between the turns (mask 0), one string per gap."""
    ids, mask = r.completion_ids, r.completion_mask
    model_ids = [t for t, m in zip(ids, mask, strict=True) if m]
    served = [t for _, c in turns for t in c.token_ids]
    assert np.array(model_ids, np.int32).tobytes() == np.array(served, np.int32).tobytes()
    served_lps = [lp for _, c in turns for lp in c.logprobs.token_logprobs]
    assert [lp for lp, m in zip(r.completion_logprobs, mask, strict=True) if m] == served_lps
    assert all(lp == 0.0 for lp, m in zip(r.completion_logprobs, mask, strict=True) if not m)
    starts = [len(prompt) - len(r.prompt_ids) for prompt, _ in turns]
    assert all(prompt == r.prompt_ids + ids[:a] for (prompt, _), a in zip(turns, starts, strict=True))
    ends = [a + len(c.token_ids) for a, (_, c) in zip(starts, turns, strict=True)]
    assert all(m == 1 for a, b in zip(starts, ends, strict=True) for m in mask[a:b]) and sum(mask) == len(served)
    assert len(r.turn_policy_versions) == len(turns)
    return [CharTokenizer().decode(ids[b:a], skip_special=False) for b, a in zip(ends, starts[1:], strict=False)]


def test_a_group_of_openenv_episodes_holds_the_servers_tokens(tmp_path, monkeypatch):
    rounds = 3
    _, _, rows, calls = _play(tmp_path, monkeypatch, {"app": "oe_echo:app", "reset_args": {"rounds": rounds}})
    for r in rows:
        turns = calls[r.sample_id]
        gaps = _assert_the_servers_tokens(r, turns)
        assert all(g.startswith("say:") and g.endswith("=") for g in gaps)  # the next word's observation
        words = [r.prompt_text[4:]] + [g[4:-1] for g in gaps]
        expected = sum(SequenceMatcher(None, c.text, w).ratio() for (_, c), w in zip(turns, words, strict=True))
        assert r.reward == pytest.approx(expected / rounds, abs=1e-6)
    assert len({r.prompt_text for r in rows}) == 1  # one task: every episode reset with the same seed


def test_mcp_tool_calls_reach_the_tools_and_their_results_are_masked(tmp_path, monkeypatch):
    args = {"app": "oe_lookup:app", "tool_parser": "oe_lookup:parse_call", "max_turns": 3}
    _, task, rows, calls = _play(tmp_path, monkeypatch, args)
    import oe_lookup  # on the path _play set

    rng = random.Random(task.seed)  # the game's reset: the key, then the salt of its values
    key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 3)))
    salt = rng.getrandbits(32)
    kinds, lookups, submits = set(), 0, 0
    for r in rows:
        turns = calls[r.sample_id]
        gaps = _assert_the_servers_tokens(r, turns)
        actions = [oe_lookup.parse_call(c.text) for _, c in turns]
        kinds |= {name for name, _ in actions}
        looked_up = [a["key"] for name, a in actions if name == "lookup"]
        assert gaps == [f"is:{oe_lookup.value(salt, k)}=" for k in looked_up[: len(gaps)]]  # the tool's answers
        submitted = actions[-1][0] == "submit"
        assert all(name == "lookup" for name, _ in actions[:-1])  # a submit ends the episode
        expected = 0.0
        if submitted:
            called = SequenceMatcher(None, looked_up[0], key).ratio() if looked_up else 0.0
            answer = SequenceMatcher(None, actions[-1][1]["answer"], oe_lookup.value(salt, key)).ratio()
            expected = 0.5 * called + 0.5 * answer
        assert r.reward == pytest.approx(expected, abs=1e-6)
        assert dict(zip(r.metric_names, r.metric_values, strict=True))["metric/done"] == float(submitted)
        lookups, submits = lookups + len(looked_up), submits + submitted
    print(
        f"{lookups} lookups and {submits} submits in {len(rows)} episodes; rewards {[round(r.reward, 3) for r in rows]}"
    )
    assert kinds == {"lookup", "submit"}, f"only {kinds} came up: the test no longer covers both tools"
