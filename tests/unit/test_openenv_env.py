"""The OpenEnv adapter's load-time checks and its server's start-up failures (engines/environments/openenv_env.py,
engines/environments/openenv_server.py), with real uvicorn processes for the apps in tests/plugins/openenv that
fail to start. Playing episodes against a served app is tests/integration/test_openenv_group.py's."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from config.envs import EnvSpec
from engines.environments import plugins

OE_ENVS = Path(__file__).resolve().parents[1] / "plugins/openenv"


@pytest.fixture
def oe_path(monkeypatch):
    monkeypatch.syspath_prepend(str(OE_ENVS))
    monkeypatch.setenv("PYTHONPATH", f"{OE_ENVS}:{Path(__file__).resolve().parents[2]}")  # the server's too


def test_openenv_env_loads_without_starting_a_server_and_draws_seeded_tasks(oe_path):
    spec = EnvSpec(id="openenv", args={"app": "oe_echo:app", "reset_args": {"rounds": 3}})
    plugins.check([spec], ["profile.toml"], "tag")
    env = plugins.build(spec)
    assert env.server.proc is None and env.server.url == ""  # the orchestrator starts it, not the CLI's check
    a, b = env.sample(random.Random(5)), env.sample(random.Random(5))
    assert a == b and 0 <= a.seed < 2**31 and a.seed != env.sample(random.Random(6)).seed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"app": "oe_nowhere:app"}, "no module 'oe_nowhere'; install its package or put it on PYTHONPATH"),
        ({"app": "oe_echo"}, "need the import path of the OpenEnv ASGI app, `module:attribute`"),
        ({"app": "oe_echo:app", "reward": "mean"}, "reward = 'mean'; valid: 'sum', 'last'"),
        ({"app": "oe_echo:app", "max_turns": 0}, "max_turns = 0; need an integer >= 1"),
        ({"app": "oe_echo:app", "startup_timeout_s": -1}, "startup_timeout_s = -1; need a number of seconds > 0"),
        ({"app": "oe_echo:app", "reset_args": [1]}, "reset_args = [1]; need a table"),
        ({"app": "oe_echo:app", "action": "message"}, "the factory accepts: app, action_field"),
        ({"app": "oe_echo:app", "tool_parser": "string:digits"}, "tool_parser = 'string:digits' is a str, not a"),
        ({"app": "oe_echo:app", "tool_parser": "string:parse"}, "module 'string' has no attribute 'parse'"),
    ],
)
def test_bad_openenv_args_are_refused_naming_the_env_and_the_value(oe_path, args, message):
    with pytest.raises(plugins.PluginError) as err:
        plugins.check([EnvSpec(id="openenv", args=args)], ["bad.toml"], "tag")
    assert "bad.toml" in str(err.value) and "'openenv'" in str(err.value) and message in str(err.value)


def test_missing_openenv_core_is_refused_with_the_install_step(oe_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # what find_spec reports for a package that is not there
    with pytest.raises(plugins.PluginError) as err:
        plugins.check([EnvSpec(id="openenv", args={"app": "oe_echo:app"})], ["p.toml"], "tag")
    assert "needs openenv-core, which is not installed" in str(err.value) and "make install" in str(err.value)


def test_tool_results_are_shown_as_their_text_or_their_error():
    from engines.environments.openenv_env import tool_text

    ok = {"tool_name": "lookup", "result": {"content": [{"type": "text", "text": "is:ab"}], "data": "is:ab"}}
    assert tool_text(ok) == "is:ab"
    assert tool_text({"tool_name": "n", "result": {"content": [], "data": {"n": 1}}}) == '{"n": 1}'
    failed = {"tool_name": "lookup", "result": None, "error": {"error_type": "timeout", "message": "timed out"}}
    assert tool_text(failed) == "error: timed out"


def _start_fails(args: dict) -> tuple[str, int]:
    env = plugins.build(EnvSpec(id="openenv", args=args))
    with pytest.raises(plugins.PluginError) as err:
        asyncio.run(env.start())
    assert env.server.proc is None and env.server.url == ""  # stopped, or exited by itself
    pid = env.server.pid
    with pytest.raises(plugins.PluginError) as again:  # another group of the step: the same failure, no new server
        asyncio.run(env.start())
    assert str(again.value) == str(err.value) and env.server.pid == pid
    return str(err.value), pid


def test_a_server_that_fails_to_start_is_reported_with_its_log(oe_path, tmp_path):
    message, pid = _start_fails({"app": "oe_broken:app", "log_dir": str(tmp_path)})
    log = next(tmp_path.glob("openenv-*.log"))
    assert f"OpenEnv environment 'openenv:oe_broken': the server for app 'oe_broken:app' (pid {pid})" in message
    assert "exited with code 1 before it was healthy" in message and f"its log {log} ends:" in message
    assert "RuntimeError: oe_broken: the word list oe_words.txt is missing" in message  # the log's last lines


def test_a_server_that_is_not_healthy_in_time_is_stopped(oe_path, tmp_path):
    message, pid = _start_fails({"app": "oe_slow:app", "log_dir": str(tmp_path), "startup_timeout_s": 1.5})
    assert "was not healthy within startup_timeout_s = 1.5 s (stopped)" in message
    assert not Path(f"/proc/{pid}").exists()  # terminated and reaped
