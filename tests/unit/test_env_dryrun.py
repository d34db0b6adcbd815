"""What loading a run checks about its environments (engines/environments/loadcheck.py, `RunConfig.env_problems`),
shown through the real CLI's `--dry-run` in a fresh process: an infinite verifiers taskset (tests/plugins/vf/vf_endless)
is read only as far as the check needs and reported; a runtime that needs remote credentials, prompts longer than
model.max_seq_len, SFT steps without demonstrations and a factory's import error are each refused with one
message naming the environment, the setting and the fix. In-process: how far the taskset was read, the built-in
multi-turn task measured with the same rule, each problem on its own, and the adapter's lazy draws."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from config.envs import EnvSpec
from config.run import RunConfig
from engines.environments import loadcheck, plugins
from engines.models.tokenizer import CharTokenizer
from rollflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
VF = ROOT / "tests" / "plugins" / "vf"
TINY = ROOT / "profiles" / "tiny-cpu.toml"
ENDLESS = 'id = "verifiers"\nargs = {{ env = "vf_endless:load_environment", env_args = {{ {} }} }}\n'


def _profile(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(f'output_dir = "{tmp_path / "run"}"\n{body}')
    return p


def _dry_run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(VF)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rollflow.cli", "rl", "@", str(TINY), "@", str(_profile(tmp_path, body)), "--dry-run"]
    # the adapter used to list the whole taskset: an infinite one never finished
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_reads_an_infinite_taskset_lazily_and_reports_what_it_checked(tmp_path):
    body = "[sft]\nsteps = 0\n[[envs]]\n" + ENDLESS.format("board_chars = 20")
    r = _dry_run(tmp_path, body)  # bounded by _dry_run's timeout: listing the taskset never returned
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("rollflow: checked"))
    assert "envs[0] (name 'verifiers', id 'verifiers'): an infinite taskset: the run draws from its first 1000" in line
    # 20 board letters + the system prompt's 21 + <bos> and '=' of the character tokenizer's template
    assert "16 first-turn prompts measured, the longest 43 tokens; no demonstrations" in line
    assert (tmp_path / "run" / "config" / "orchestrator.json").is_file()


def test_dry_run_refuses_each_environment_problem_naming_the_setting_and_the_fix(tmp_path):
    body = (
        "[[envs]]\n"
        + ENDLESS.format("board_chars = 1000")  # a game-sized prompt; tiny-cpu: max_seq_len 64, sft 200
        + '[[envs]]\nname = "sandboxed"\n'
        + ENDLESS.format("sandboxed = true")  # verifiers' default runtime
        + '[[envs]]\nname = "missing"\nid = "verifiers"\nargs = { env = "vf_nowhere:load_environment" }\n'
    )
    r = _dry_run(tmp_path, body)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "rollflow: invalid environment:" and len(lines) == 5, r.stderr
    where = f"{tmp_path / 'p.toml'}: envs"
    # 4: a runtime that needs remote credentials, and verifiers' default interception, each with its fix
    (sandboxed,) = [x for x in lines if f"{where}[1] (name 'sandboxed'" in x]
    assert "agent 'agent' runs in the 'prime' runtime" in sandboxed and "$PRIME_API_KEY" in sandboxed
    assert "set `agent = AgentConfig(runtime=SubprocessConfig())`" in sandboxed
    assert "set `interception = InterceptionServerConfig()`" in sandboxed
    # 5: the measured prompts against model.max_seq_len
    assert any(
        f"{where}[0] (name 'verifiers', id 'verifiers'): its first-turn prompts take up to 1023 tokens (16 measured"
        in x
        and "more than model.max_seq_len=64" in x
        and "set model.max_seq_len >= 1035" in x
        for x in lines
    ), r.stderr
    # 6: SFT steps with an environment that has no demonstrations
    assert any(f"{where}[0]" in x and "has no demonstrations" in x and "sft.steps=200" in x for x in lines)
    assert any("set [sft] steps = 0" in x for x in lines)
    # 7: the factory's own import error, wrapped once
    (missing,) = [x for x in lines if f"{where}[2] (name 'missing'" in x]
    assert missing.endswith(
        "): cannot import module 'vf_nowhere' (No module named 'vf_nowhere'); install the "
        "package that provides it or put its directory on PYTHONPATH"
    ), missing
    assert "raised" not in missing and "PluginError" not in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture
def vf_path(monkeypatch):
    monkeypatch.syspath_prepend(str(VF))


def test_loading_reads_only_the_first_tasks_of_an_infinite_taskset(vf_path):
    import vf_endless

    spec = EnvSpec(id="verifiers", args={"env": "vf_endless:load_environment"})
    before = vf_endless.BUILT[0]
    facts, problems = loadcheck.inspect([spec], ["p.toml"], "tag", CharTokenizer())
    assert not problems and vf_endless.BUILT[0] - before == loadcheck.PROMPT_SAMPLE
    env = plugins.build(spec)
    draws = [env.sample(random.Random(k)) for k in range(20)]
    assert all(0 <= t.index < 1000 for t in draws) and len({t.index for t in draws}) > 10
    assert vf_endless.BUILT[0] - before == loadcheck.PROMPT_SAMPLE + max(t.index for t in draws) + 1
    assert [t.index for t in draws] == [plugins.build(spec).sample(random.Random(k)).index for k in range(20)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[sft]\nsteps = 0\n[[envs]]\n" + ENDLESS.format("board_chars = 100"), "set model.max_seq_len >= 135"),
        ("[[envs]]\n" + ENDLESS.format(""), "has no demonstrations (it runs its own episodes"),
        ("[sft]\nsteps = 0\n[[envs]]\n" + ENDLESS.format("sandboxed = true"), "runs in the 'prime' runtime"),
        ('[[envs]]\nid = "tool-lookup"\nargs = { min_chars = 50, max_chars = 60 }\n', "set model.max_seq_len >= 78"),
    ],
    ids=["max_seq_len", "sft-steps", "remote-runtime", "built-in-multi-turn"],
)
def test_each_problem_alone_is_refused(vf_path, tmp_path, capsys, body, message):
    assert main(["rl", "@", str(TINY), "@", str(_profile(tmp_path, body)), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n  ") == 1 and message in err, err


def test_sft_with_a_dataset_needs_no_demonstrations(vf_path):
    from config.envs import EnvFacts

    facts = [EnvFacts("p.toml: envs[0]", 16, 20, False, "16 tasks drawn")]
    cfg = RunConfig(sft={"steps": 200, "data": {"path": "chat.jsonl"}})
    assert cfg.env_problems(facts) == [] and RunConfig().env_problems(facts) != []
    assert RunConfig().env_problems(facts, rl=False)[0].endswith("or use environments with demonstrations")


def test_a_task_with_no_room_for_its_first_turn_is_refused_not_retried(vf_path):
    """At run time a first prompt that leaves no room in model.max_seq_len raises EnvironmentRefused (the
    orchestrator exits EXIT_REFUSED, which the rl flow does not restart) before anything is sampled."""
    import asyncio
    from types import SimpleNamespace

    from engines.environments.base import EnvironmentRefused
    from engines.environments.episodes import run_episode

    tok = CharTokenizer()
    lookup = plugins.build(EnvSpec(id="tool-lookup", args={"min_chars": 50, "max_chars": 60}))
    task = lookup.sample(random.Random(0))
    sampled = []

    async def sample(request, session):
        sampled.append(request)

    with pytest.raises(EnvironmentRefused, match=r"tool-lookup: a first prompt takes \d+ tokens.*max_seq_len=40"):
        asyncio.run(run_episode(lookup, task, tok, sample, lambda *a: a, "s", 40))
    assert sampled == []
    env = plugins.build(EnvSpec(id="verifiers", args={"env": "vf_endless:load_environment", "env_args": {}}))
    task = env.sample(random.Random(0))  # 12 board letters + a 21-letter system prompt: 35 tokens
    env._check_room(SimpleNamespace(tok=tok, max_seq_len=36), task)
    with pytest.raises(EnvironmentRefused, match=r"task \d+'s first prompt takes 35 tokens.*max_seq_len=35"):
        env._check_room(SimpleNamespace(tok=tok, max_seq_len=35), task)


def test_max_tasks_bounds_what_a_run_draws_from(vf_path):
    env = plugins.build(EnvSpec(id="verifiers", args={"env": "vf_copy:load_environment", "max_tasks": 3}))
    assert env.tasks.size() == 3 and {env.sample(random.Random(k)).index for k in range(40)} == {0, 1, 2}
    assert env.tasks.describe() == "a finite taskset: the run draws from its first 3 tasks"
    with pytest.raises(plugins.PluginError, match=r"args.max_tasks = 0: need a positive integer"):
        plugins.build(EnvSpec(id="verifiers", args={"env": "vf_copy:load_environment", "max_tasks": 0}))
