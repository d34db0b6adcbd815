"""The verifiers adapter (engines/environments/verifiers_env.py, engines/environments/verifiers_client.py) without a
server: loading
the test suite's verifiers environments through the plugin mechanism, its load-time errors, and the token
client's refusal to train on a conversation whose history was rewritten."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from config.envs import EnvSpec
from engines.environments import plugins
from engines.models.tokenizer import CharTokenizer

VF_ENVS = Path(__file__).resolve().parents[1] / "plugins/vf"


@pytest.fixture
def vf_path(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))


def test_verifiers_env_loads_as_a_plugin_and_samples_its_taskset(vf_path):
    spec = EnvSpec(id="verifiers", args={"env": "vf_lookup:load_environment", "env_args": {"num_tasks": 5}})
    plugins.check([spec], ["profile.toml"], "tag")
    env = plugins.build(spec)
    task = env.sample(random.Random(0))
    assert env.tasks.size() == 5 and task.prompt == env.tasks[task.index].data.prompt
    assert task.prompt.startswith("get:")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"env": "vf_tools:value"}, "args.env 'vf_tools:value' raised TypeError"),  # needs arguments it is not given
        ({"env": "vf_tools:parse_calls", "env_args": {"text": "x"}}, "not a verifiers.v1.Env"),
        ({"env": "vf_nowhere:load_environment"}, "cannot import module 'vf_nowhere'"),
        ({"env": "vf_copy:load_environment", "tool_parser": "vf_tools:TOOLS"}, "is not callable"),
    ],
)
def test_bad_verifiers_env_is_refused_naming_it(vf_path, args, message):
    with pytest.raises(plugins.PluginError) as err:
        plugins.check([EnvSpec(id="verifiers", args=args)], ["bad.toml"], "tag")
    assert "bad.toml" in str(err.value) and "'verifiers'" in str(err.value) and message in str(err.value)


def test_token_client_extends_the_sampled_ids_and_refuses_rewritten_history():
    from engines.environments.episodes import Episode
    from engines.environments.verifiers_client import TokenClient, _Session

    tok = CharTokenizer()
    group = SimpleNamespace(tok=tok, temperature=1.0)
    client = TokenClient(group, None, None)  # type: ignore[arg-type]
    s = _Session(0, "g", 1, 0, "run/g-00")
    client._extend(s, [{"role": "user", "content": "get:ab"}])
    assert s.episode is not None and s.episode.prompt_ids == tok.render_prompt("get:ab")
    s.episode.completion_ids += tok.encode("?ab", bos=False) + [tok.eos_id]  # what the server sampled
    s.seen = 2
    history = [{"role": "user", "content": "get:ab"}, {"role": "assistant", "content": "?ab"}]
    client._extend(s, [*history, {"role": "tool", "content": "is:xy"}])
    assert tok.decode(s.episode.completion_ids, skip_special=False) == "?ab<eos>is:xy="
    assert isinstance(s.episode, Episode) and s.episode.completion_mask[-6:] == [0] * 6
    s.seen = 4
    with pytest.raises(RuntimeError, match="does not extend the last sampled reply"):
        client._extend(s, history)  # the conversation lost its last turns
