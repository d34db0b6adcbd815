"""OpenEnv environments end to end: the real CLI, inference server, orchestrator and trainer on an OpenEnv
environment served locally (tests/plugins/openenv/oe_echo.py, a copy game written against openenv-core's public
API), which the orchestrator starts on 127.0.0.1 and plays over openenv-core's WebSocket client
(engines/environments/openenv_env.py). Each model turn's request ids and the server's choice are recorded as
the orchestrator received them (`record`); the lake must hold exactly those tokens and logprobs, the mask on
exactly the model tokens, the observations between the turns, and the rewards the OpenEnv server gave. Both tests
are `long` (the run takes 1-3 min on the shared 2-core machine; tests/integration/test_openenv_group.py is the
default suite's version, one group in one process)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections import Counter
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from conftest import ROOT, cli_argv, cli_env, processes_mentioning, turn_spans

from config.envs import EnvSpec
from engines.environments import plugins
from engines.models.tokenizer import CharTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.long]
OE_ENVS = ROOT / "tests/plugins/openenv"
STEPS, EPISODES, ROUNDS = 3, 4 * 4, 2


def _run(tmp_path: Path) -> tuple[Path, Path]:
    out, record, logs = tmp_path / "run", tmp_path / "turns.jsonl", tmp_path / "oe-logs"
    args = (
        f'app = "oe_echo:app", record = "{record}", log_dir = "{logs}", max_sessions = 16, max_turns = 4, '
        f"reset_args = {{ rounds = {ROUNDS} }}"
    )
    (tmp_path / "env.toml").write_text(f'[[envs]]\nid = "openenv"\nargs = {{ {args} }}\n')
    profiles = ["@", str(ROOT / "profiles/tiny-tools-cpu.toml"), "@", str(ROOT / "tests/profiles/openenv-short.toml")]
    argv = cli_argv("rl", *profiles, "@", str(tmp_path / "env.toml"), "--output-dir", str(out))
    env_vars = cli_env(None)
    env_vars["PYTHONPATH"] = os.pathsep.join([str(OE_ENVS), env_vars.get("PYTHONPATH", str(ROOT))])
    proc = subprocess.run(argv, cwd=tmp_path, env=env_vars, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(logs.glob("openenv-*.log")), "the OpenEnv server wrote no log where log_dir says"
    return out, record


def _assert_turns_are_the_servers(r: dict, turns: dict) -> list[tuple[int, int]]:
    """Each run of mask-1 tokens is one model turn and equals the server's token ids byte for byte (logprobs to
    float32); the request of turn k was exactly prompt_ids + the completion before it; versions are the server's."""
    ids, lps = r["completion_ids"], r["completion_logprobs"]
    spans = turn_spans(r["completion_mask"])
    assert len(spans) == len(r["turn_policy_versions"])
    for k, (a, b) in enumerate(spans):
        t = turns[(r["sample_id"], k)]
        choice = t["choice"]
        assert np.array(ids[a:b], np.int32).tobytes() == np.array(choice["token_ids"], np.int32).tobytes()
        lp = choice["logprobs"]["token_logprobs"]
        assert np.array(lps[a:b], np.float32).tobytes() == np.array(lp, np.float32).tobytes()
        assert t["prompt"] == r["prompt_ids"] + ids[:a]
        assert r["turn_policy_versions"][k] == choice["policy_version"]
        assert r["turn_policy_versions_end"][k] == choice["policy_version_end"]
    assert (r["sample_id"], len(spans)) not in turns  # no model turn the row lacks
    return spans


def _assert_episode(r: dict, turns: dict, tok: CharTokenizer) -> None:
    """The observations sit between the turns (mask 0, logprob 0) and the reward is the server's: the sum over
    the turns of similarity(reply, word) / ROUNDS, the words read back from the prompt and the observations."""
    ids, mask, lps = r["completion_ids"], r["completion_mask"], r["completion_logprobs"]
    assert len(ids) == len(mask) == len(lps) and mask[-1] == 1
    assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
    spans = _assert_turns_are_the_servers(r, turns)
    gaps = [tok.decode(ids[b:a], skip_special=False) for (_, b), (a, _) in zip(spans, spans[1:], strict=False)]
    assert all(g.startswith("say:") and g.endswith("=") for g in gaps)  # the next word's observation, rendered
    assert r["prompt_text"].startswith("say:") and r["prompt_ids"] == tok.render_prompt(r["prompt_text"])
    words = [r["prompt_text"][4:]] + [g[4:-1] for g in gaps]
    replies = [turns[(r["sample_id"], k)]["choice"]["text"] for k in range(len(spans))]
    expected = sum(SequenceMatcher(None, a, w).ratio() for a, w in zip(replies, words, strict=True)) / ROUNDS
    assert r["reward"] == pytest.approx(expected, abs=1e-6)
    scores = dict(zip(r["metric_names"], r["metric_values"], strict=True))
    assert scores["metric/turns"] == len(spans) and scores["metric/done"] == float(len(spans) == ROUNDS)


def test_openenv_env_trains_on_the_server_tokens(tmp_path):
    out, record = _run(tmp_path)
    turns = {}
    for line in record.read_text().splitlines():
        t = json.loads(line)
        turns[(t["sample_id"], t["turn"])] = t  # a restarted orchestrator redraws a step: the last wins
    rows = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table().to_pylist()
    assert len(rows) == STEPS * EPISODES
    tok = CharTokenizer()
    for r in rows:
        _assert_episode(r, turns, tok)
    two = sum(len(r["turn_policy_versions"]) == ROUNDS for r in rows)
    finish = Counter(r["finish_reason"] for r in rows)
    print(f"episodes with {ROUNDS} turns: {two}/{len(rows)}; mean reward {np.mean([r['reward'] for r in rows]):.3f}")
    print(f"last turn's finish reasons: {dict(finish)}")
    assert two > 0, "no episode reached the second round"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:  # the trainer counted exactly the model tokens
        assert m["tokens"] == sum(sum(r["completion_mask"]) for r in rows if r["step"] == m["step"])
    kls = [m["mismatch_kl"] for m in metrics if m["mismatch_kl"] is not None]
    print(f"mismatch_kl: max {max(kls, default=float('nan')):.1e} over {len(kls)} steps")
    assert kls and max(kls) <= 1e-7  # same fp32 weights on both sides (the verifiers runs measured 0.0)
    assert not processes_mentioning("oe_echo:app"), "the OpenEnv server outlived the run"


def test_an_action_field_the_app_lacks_is_refused_with_its_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(OE_ENVS), str(ROOT)]))
    monkeypatch.syspath_prepend(str(OE_ENVS))
    env = plugins.build(EnvSpec(id="openenv", args={"app": "oe_echo:app", "action_field": "text"}))
    with pytest.raises(plugins.PluginError) as err:
        asyncio.run(env.start())
    assert "action_field = 'text' is not a string field of the app's action; its string fields: message" in str(
        err.value
    )
    assert env.server.proc is None and not Path(f"/proc/{env.server.pid}").exists()  # stopped
