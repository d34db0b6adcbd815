"""verifiers' own TextArena environment (verifiers 0.4.0 + textarena 0.7.4, Hangman) played by verifiers'
shipped `null` harness, offline, through rollflow's real inference server.

The harness is verifiers' chat program in a subprocess (it streams every model call); the game engine plays
the user between model turns (verifiers' TextArenaEnv resumes the harness on the conversation). NLTK's
`words` corpus is the stand-in rollflow writes from textarena's bundled dictionaries
(engines/environments/verifiers_textarena.py). Each model turn's request ids and the server's choice are
recorded as the orchestrator received them (`record`); every row must hold exactly those tokens, the mask
on exactly them.

- `test_textarena_group_is_token_exact_through_the_server` (default suite): one group of episodes run by
  the plugin in-process against a real `python -m engines.inference` server, through the orchestrator's own
  `EpisodeGroup`.
- `test_textarena_rl_run_trains_on_the_server_tokens` (long): a shortened `rollflow rl` through the real
  CLI, server, orchestrator and trainer.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from pathlib import Path

import httpx
import pyarrow.dataset as ds
import pytest
from conftest import ROOT, cli_argv, cli_env, turn_spans

from config.envs import EnvSpec
from config.model import ModelConfig
from config.orchestrator import OrchestratorConfig
from engines.environments import plugins
from engines.environments.verifiers_textarena import write_words_corpus
from engines.models.tokenizer import CharTokenizer
from engines.orchestrator.multiturn import EpisodeGroup
from tests.inference_fixture import publish, serving

pytestmark = pytest.mark.slow
FACTORY = "engines.environments.verifiers_textarena:load_environment"
MAX_SEQ_LEN = 2048  # the Hangman prompt and verifiers' system prompt are ~1,100 characters


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nltk")
    write_words_corpus(root)
    return root


def _assert_exact(rows: list[dict], record: Path) -> int:
    """Every row's model turns are the server's choices byte for byte, each turn's request was the stored
    context before it, mask 1 on exactly the model tokens; returns the number of user turns seen."""
    turns = {}
    for line in record.read_text().splitlines():
        t = json.loads(line)
        turns[(t["sample_id"], t["turn"])] = t  # a restarted orchestrator redraws a step: the last wins
    user_turns = 0
    for r in rows:
        ids, mask, lps = r["completion_ids"], r["completion_mask"], r["completion_logprobs"]
        spans = turn_spans(mask)
        assert len(spans) == len(r["turn_policy_versions"]) >= 1
        for k, (a, b) in enumerate(spans):
            choice = turns[(r["sample_id"], k)]["choice"]
            assert ids[a:b] == choice["token_ids"]
            assert lps[a:b] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
            assert turns[(r["sample_id"], k)]["prompt"] == r["prompt_ids"] + ids[:a]
            assert r["turn_policy_versions"][k] == choice["policy_version"]
        assert (r["sample_id"], len(spans)) not in turns  # no model turn the row lacks
        assert sum(mask) == sum(b - a for a, b in spans)
        user_turns += len(spans) - 1
    return user_turns


async def _run_group(url: str, record: Path, nltk_data: Path, group_size: int, max_turns: int) -> list[dict]:
    args = {"game": "Hangman-v0", "num_tasks": 4, "nltk_data": str(nltk_data), "max_turns": max_turns}
    env = plugins.build(EnvSpec(id="verifiers", args={"env": FACTORY, "env_args": args, "record": str(record)}))
    ocfg = OrchestratorConfig(group_size=max(group_size, 2), max_new_tokens=8, temperature=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        group = EpisodeGroup(client, asyncio.Semaphore(8), CharTokenizer(), ocfg, seed=0, max_seq_len=MAX_SEQ_LEN)
        group.group_size = group_size  # the config insists on >= 2; the env runs what the group says
        task = env.sample(random.Random(0))
        try:
            rows = await env.run_group(group, task, "t", 1, 0)
        finally:
            await env.close()
    return [r.model_dump() for r in rows]


def test_textarena_group_is_token_exact_through_the_server(tmp_path, nltk_data):
    """One Hangman episode (a group of one: each episode launches verifiers' chat program once per turn) of
    two model turns, the game's feedback between them: the game's first answer is never its last (a first
    invalid move is forgiven, a valid guess that does not finish the word goes on)."""
    model_cfg = ModelConfig(max_seq_len=MAX_SEQ_LEN)
    publish(str(tmp_path), model_cfg, 0, seed=0)
    record = tmp_path / "turns.jsonl"
    with serving(str(tmp_path), model_cfg) as http:
        (row,) = asyncio.run(_run_group(str(http.base_url), record, nltk_data, group_size=1, max_turns=2))
    assert _assert_exact([row], record) == 1  # two model turns, the game's answer between them
    (_, b), (c, _) = turn_spans(row["completion_mask"])
    user = CharTokenizer().decode(row["completion_ids"][b:c], skip_special=False)
    assert user.endswith("=") and ("guess" in user or "invalid move" in user)  # textarena's feedback
    scores = dict(zip(row["metric_names"], row["metric_values"], strict=True))
    assert row["reward"] == pytest.approx(scores["reward/game_reward"], abs=1e-6)


@pytest.mark.long
def test_textarena_rl_run_trains_on_the_server_tokens(tmp_path, nltk_data):
    out, record = tmp_path / "run", tmp_path / "turns.jsonl"
    env_args = f'game = "Hangman-v0", num_tasks = 16, nltk_data = "{nltk_data}", max_turns = 3'
    args = f'env = "{FACTORY}", record = "{record}", env_args = {{ {env_args} }}'
    (tmp_path / "env.toml").write_text(f'[[envs]]\nid = "verifiers"\nargs = {{ {args} }}\n')
    profiles = ["@", str(ROOT / "profiles/tiny-tools-cpu.toml"), "@", str(ROOT / "tests/profiles/textarena-short.toml")]
    argv = cli_argv("rl", *profiles, "@", str(tmp_path / "env.toml"), "--output-dir", str(out))
    proc = subprocess.run(argv, cwd=tmp_path, env=cli_env(None), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table().to_pylist()
    assert len(rows) == 3 * 2 * 2  # steps x prompts x episodes
    user_turns = _assert_exact(rows, record)
    assert user_turns >= len(rows)  # every episode had the game answer between model turns at least once
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # the trainer counted exactly the model tokens
        assert m["tokens"] == sum(sum(r["completion_mask"]) for r in rows if r["step"] == m["step"])
        assert "env/reward/game_reward" in m
    kls = [m["mismatch_kl"] for m in metrics if m["mismatch_kl"] is not None]
    print(f"mismatch_kl: max {max(kls, default=float('nan')):.1e} over {len(kls)} steps; user turns {user_turns}")
    assert kls and max(kls) <= 1e-7
