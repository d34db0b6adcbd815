"""CharTokenizer (and its Hugging Face export) and the environments / weighted mix."""

from __future__ import annotations

import os
import random
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from config.envs import EnvSpec
from config.registry import STRING_TASKS
from config.run import PROMPT_OVERHEAD_TOKENS
from engines.environments.base import EnvMix, build
from engines.models.tokenizer import CHARS, SPECIAL, CharTokenizer

TOK = CharTokenizer()
SAMPLE = "rev:hello world, 42! sort:a-b_c.d?="


def test_vocab_layout():
    assert TOK.vocab_size == len(SPECIAL) + len(CHARS) == len(set(TOK.vocab.values()))
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.unk_id) == (0, 1, 2, 3)


def test_encode_decode_round_trip():
    ids = TOK.encode(SAMPLE)
    assert ids[0] == TOK.bos_id and len(ids) == len(SAMPLE) + 1
    assert TOK.encode(SAMPLE, bos=False) == ids[1:]
    assert TOK.decode(ids) == SAMPLE
    assert TOK.decode(ids + [TOK.eos_id, TOK.pad_id]) == SAMPLE  # specials skipped
    assert TOK.decode([TOK.bos_id, *ids[1:3]], skip_special=False) == "<bos>" + SAMPLE[:2]
    # unknown characters map to <unk> and vanish on decode
    assert TOK.encode("aZb", bos=False) == [TOK.vocab["a"], TOK.unk_id, TOK.vocab["b"]]
    assert TOK.decode(TOK.encode("aZb")) == "ab"


def test_hf_export_matches(tmp_path):
    transformers = pytest.importorskip("transformers")
    TOK.save_pretrained(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(hf) == TOK.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (
        TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.unk_id,
    )  # fmt: skip
    # the HF tokenizer adds no special tokens itself: compare with bos=False
    assert hf(SAMPLE)["input_ids"] == TOK.encode(SAMPLE, bos=False)
    assert hf.encode(SAMPLE, add_special_tokens=False) == TOK.encode(SAMPLE, bos=False)
    assert hf("aZb")["input_ids"] == TOK.encode("aZb", bos=False)
    # an explicit "<bos>" in the text is the bos token, so the chat-rendered prompt round-trips
    assert hf("<bos>" + SAMPLE)["input_ids"] == TOK.encode(SAMPLE)
    assert hf.decode(TOK.encode(SAMPLE), skip_special_tokens=True) == SAMPLE

    rendered = hf.apply_chat_template(
        [{"role": "user", "content": "rev:abc"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<bos>rev:abc="
    assert hf(rendered)["input_ids"] == TOK.encode("rev:abc=")
    no_gen = hf.apply_chat_template([{"role": "user", "content": "rev:abc"}], tokenize=False)
    assert no_gen == "<bos>rev:abc"


@pytest.mark.parametrize("name", STRING_TASKS)
def test_tasks_deterministic_per_key(name):
    mix = EnvMix([EnvSpec(name=name)], seed=3)
    again = EnvMix([EnvSpec(name=name)], seed=3)
    keys = [f"step={s}/group={g}" for s in range(1, 4) for g in range(8)]
    tasks = [mix.task(k) for k in keys]
    assert tasks == [again.task(k) for k in keys]
    assert tasks == [mix.task(k) for k in keys]  # no hidden state between calls
    assert len({t.prompt for t in tasks}) > len(keys) // 2  # keys give different tasks
    other_seed = EnvMix([EnvSpec(name=name)], seed=4)
    assert [other_seed.task(k) for k in keys] != tasks
    assert all(t.env == name for t in tasks)


def test_reverse_and_sort_answers():
    rng = random.Random(0)
    rev = build(EnvSpec(name="reverse-text", min_chars=2, max_chars=6))
    srt = build(EnvSpec(name="sort-letters", min_chars=2, max_chars=6))
    for _ in range(50):
        t = rev.sample(rng)
        assert t.prompt.startswith("rev:") and TOK.render_prompt(t.prompt) == TOK.encode(t.prompt + "=")
        payload = t.prompt[len("rev:") :]
        assert 2 <= len(payload) <= 6 and payload.isalpha() and payload.islower()
        assert t.answer == payload[::-1]
        s = srt.sample(rng)
        assert s.prompt.startswith("sort:")
        payload = s.prompt[len("sort:") :]
        assert 2 <= len(payload) <= 6
        assert s.answer == "".join(sorted(payload))
        assert list(s.answer) == sorted(s.answer)


def test_prompt_length_within_config_overhead():
    for name in STRING_TASKS:
        mix = EnvMix([EnvSpec(name=name, min_chars=8, max_chars=8)], seed=0)
        for k in range(20):
            t = mix.task(str(k))
            ids = TOK.render_prompt(t.prompt)
            assert len(ids) <= 8 + PROMPT_OVERHEAD_TOKENS
            assert TOK.decode(ids) == t.prompt + "="  # every prompt char is in the vocab


def test_reward():
    mix = EnvMix([EnvSpec(name="reverse-text"), EnvSpec(name="sort-letters")], seed=0)
    for k in range(20):
        t = mix.task(f"k{k}")
        assert mix.reward(t, t.answer) == 1.0
        wrong = t.answer[:-1] + ("a" if t.answer[-1] != "a" else "b")
        assert mix.reward(t, wrong) < 1.0
        assert mix.reward(t, "") < mix.reward(t, wrong)
        assert 0.0 <= mix.reward(t, "zzzzzzzz") < 1.0
        assert mix.reward(t, t.answer + "xyz") < 1.0


def test_single_env_mix_only_draws_that_env():
    for name in STRING_TASKS:
        mix = EnvMix([EnvSpec(name=name, weight=0.3)], seed=1)
        assert {mix.task(str(k)).env for k in range(200)} == {name}


def test_mix_respects_weights():
    mix = EnvMix([EnvSpec(name="reverse-text", weight=1.0), EnvSpec(name="sort-letters", weight=3.0)], seed=0)
    n = 4000
    counts = Counter(mix.task(f"step={k // 16}/group={k % 16}").env for k in range(n))
    frac = counts["sort-letters"] / n
    assert abs(frac - 0.75) < 0.04  # ~5 standard deviations


def test_env_spec_validation():
    with pytest.raises(ValueError, match="min_chars <= max_chars"):
        build(EnvSpec(name="reverse-text", min_chars=5, max_chars=4))
    with pytest.raises(ValueError):
        EnvSpec(name="reverse-text", weight=0)
    with pytest.raises(ValueError, match="no environment named 'no-such-env'"):
        build(EnvSpec(name="no-such-env"))
    # the top-level payload keys of older profiles are the built-in factories' args
    assert EnvSpec(name="sort-letters", max_chars=5).args == {"max_chars": 5}


def test_char_chat_template_renders_the_tag_prompt_ids():
    """The built-in format through the template: <bos> + message + '=' (the ids runs always used)."""
    assert TOK.render_prompt("rev:abc") == [TOK.bos_id, *TOK.encode("rev:abc=", bos=False)]
    two = [{"role": "user", "content": "rev:"}, {"role": "user", "content": "ab"}]
    assert TOK.render_messages(two) == TOK.encode("rev:ab=")


def test_instruct_style_prompts_and_reward():
    rng = random.Random(0)
    env = build(EnvSpec(name="reverse-text", min_chars=4, max_chars=4), default_style="instruct")
    t = env.sample(rng)
    payload = t.answer[::-1]
    assert payload in t.prompt and t.prompt.startswith("Reverse") and not t.prompt.startswith("rev:")
    assert env.reward(t, f" {t.answer}\n") == 1.0  # chat answers' surrounding whitespace is ignored
    tag = build(EnvSpec(name="reverse-text", min_chars=4, max_chars=4, prompt="tag"), default_style="instruct")
    assert tag.sample(random.Random(0)).prompt == f"rev:{payload}"  # same draw, explicit style wins
    assert tag.reward(t, f" {t.answer}") < 1.0  # the tag style scores the text as generated


def test_a_publication_of_the_built_in_model_keeps_its_tag_prompts(tmp_path):
    """A run that starts from a built-in model's publication (`model.path = weights/step=N`) must see the prompts
    it was trained on: the char tokenizer's `tag` style, not the `instruct` style of other model directories."""
    from config.model import ModelConfig
    from engines.models import modeldir

    TOK.save_pretrained(tmp_path / "pub")
    loaded = modeldir.load_tokenizer(modeldir.ModelSource(ModelConfig(), "custom", tmp_path / "pub", {}))
    assert isinstance(loaded, CharTokenizer) and loaded.prompt_style == "tag"

    other = tmp_path / "other"  # the same files with another chat template: a directory's own tokenizer
    TOK.save_pretrained(other)
    config = (other / "tokenizer_config.json").read_text().replace("={% endif %}", "=>{% endif %}")
    (other / "tokenizer_config.json").write_text(config)
    hf = modeldir.load_tokenizer(modeldir.ModelSource(ModelConfig(), "custom", other, {}))
    assert not isinstance(hf, CharTokenizer) and hf.prompt_style == "instruct"
