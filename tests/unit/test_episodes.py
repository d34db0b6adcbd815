"""Multi-turn episodes: token-level assembly, the lake's mask columns, and the trainer's use of the mask."""

from __future__ import annotations

import asyncio
import random

import pyarrow as pa
import pytest
import torch

from config.envs import EnvSpec
from config.model import ModelConfig
from config.trainer import TrainerConfig
from engines.environments.base import EnvMix
from engines.environments.episodes import demonstration_ids, run_episode
from engines.environments.tools import ToolLookup
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from engines.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest
from engines.trainer.batch import make_batch, pack_batch
from engines.trainer.common import batch_logprobs, packed_logprobs
from engines.trainer.losses.objective import Objective, counts_of, token_scores
from storage import rollouts

TOK = CharTokenizer()


def _env() -> ToolLookup:
    return ToolLookup("tool-lookup", 3, 5)


def test_tool_lookup_answers_the_key_asked_and_scores_the_final_reply():
    env = _env()
    task = env.sample(random.Random(1))
    call, answer = env.demonstration(task)
    (msg,) = env.respond(task, [call]) or []
    assert msg["content"] == f"is:{task.answer}"
    assert env.respond(task, ["no call"]) is None  # no tool call ends the episode
    other = env.respond(task, ["?zzzz"])
    assert other is not None and other[0]["content"] != msg["content"]  # another key, another value
    assert env.score(task, [call, answer]) == 1.0
    assert env.score(task, [call, "qqqqqqq"]) < 0.75
    assert env.score(task, [answer]) <= 0.5  # no call: at most the answer's half


def test_demonstration_masks_replies_and_eos_only():
    env = _env()
    task = env.sample(random.Random(2))
    ids, mask = demonstration_ids(env, task, TOK)
    text = TOK.decode(ids, skip_special=False)
    assert text == f"<bos>{task.prompt}=?{task.key}<eos>is:{task.answer}={task.answer}<eos>"
    trained = TOK.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
    assert trained == f"?{task.key}<eos>{task.answer}<eos>"


def _choice(text: str, version: int, finish: str = "stop") -> CompletionChoice:
    ids = TOK.encode(text, bos=False) + ([TOK.eos_id] if finish == "stop" else [])
    lps = [-0.1 * (k + 1) for k in range(len(ids))]
    return CompletionChoice(
        index=0,
        text=text,
        finish_reason=finish,
        logprobs=CompletionLogprobs(tokens=[""] * len(ids), token_logprobs=lps),
        token_ids=ids,
        policy_version=version,
        policy_version_end=version,
    )


def _episode(replies: list[tuple[str, str]]):
    """Run an episode against scripted choices; returns it and the requests (with session ids) it made."""
    env, task = _env(), _env().sample(random.Random(3))
    script = iter(replies)
    seen: list[tuple[CompletionRequest, str]] = []

    async def sample(request: CompletionRequest, session: str) -> CompletionChoice:
        seen.append((request, session))
        text, finish = next(script)
        return _choice(text.replace("KEY", task.key), len(seen) - 1, finish)

    def request(context, room, turn):
        return CompletionRequest(prompt=context, max_tokens=min(8, room), logprobs=1, return_token_ids=True)

    return asyncio.run(run_episode(env, task, TOK, sample, request, "sess-1", 64)), seen, task


def test_episode_is_built_from_sampled_ids_plus_rendered_tool_tokens():
    episode, seen, task = _episode([("?KEY", "stop"), ("abc", "stop")])
    assert [s for _, s in seen] == ["sess-1", "sess-1"]  # one session for the whole episode
    first, second = (r.prompt for r, _ in seen)
    assert first == TOK.render_prompt(task.prompt)
    call = TOK.encode(f"?{task.key}", bos=False) + [TOK.eos_id]
    tool = TOK.render_continuation([{"role": "user", "content": f"is:{task.answer}"}])
    assert second == first + call + tool  # the sampled ids, never re-tokenized text
    assert episode.completion_ids == call + tool + TOK.encode("abc", bos=False) + [TOK.eos_id]
    assert episode.completion_mask == [1] * len(call) + [0] * len(tool) + [1] * 4
    assert [lp for lp, m in zip(episode.completion_logprobs, episode.completion_mask, strict=True) if not m] == [
        0.0
    ] * len(tool)
    assert episode.turn_versions == [0, 1] and episode.replies[-1] == "abc"


def test_episode_ends_on_truncated_turn_or_no_call():
    episode, seen, _ = _episode([("?KEY", "length")])
    assert len(seen) == 1 and episode.completion_mask[-1] == 1
    episode, seen, _ = _episode([("xyz", "stop")])
    assert len(seen) == 1 and set(episode.completion_mask) == {1}


def _row(k: int, mask, ids, lps, **extra) -> dict:
    return {
        "run_id": "r",
        "step": 1,
        "sample_id": f"s-{k}",
        "group_id": "g",
        "env": "tool-lookup",
        "policy_version": 0,
        "policy_version_end": 0,
        "prompt_ids": [1, 20, 21, 5],
        "completion_ids": ids,
        "completion_logprobs": lps,
        "reward": 0.5,
        "advantage": 1.0 - k,
        "temperature": 1.0,
        "finish_reason": "stop",
        "prompt_text": "get:ab",
        "completion_text": "",
        "completion_mask": mask,
        "turn_policy_versions": None if mask is None else [0, 0],
        "turn_policy_versions_end": None if mask is None else [0, 0],
        **extra,
    }


def _rows():
    return [
        _row(0, [1, 1, 0, 0, 0, 1, 1], [30, 2, 20, 21, 5, 31, 2], [-1.0, -0.5, 0, 0, 0, -2.0, -0.1]),
        _row(1, None, [22, 23, 2], [-0.3, -0.2, -0.1]),
    ]


def test_lake_round_trips_mask_and_refuses_bad_episodes():
    table = rollouts.to_table(_rows())
    assert table.column("completion_mask").to_pylist()[0] == [1, 1, 0, 0, 0, 1, 1]
    assert table.schema.field("completion_mask").type == pa.list_(pa.int8())
    for bad, match in [
        ({"completion_mask": [1, 1, 0]}, "completion_mask"),  # wrong length
        ({"completion_mask": [1, 1, 0, 0, 0, 1, 0]}, "ending with a model token"),
        ({"turn_policy_versions": None}, "turn_policy_versions"),
    ]:
        row = {**_rows()[0], **bad}
        with pytest.raises(ValueError, match=match):
            rollouts.to_table([row])


def test_trainer_masks_environment_tokens_and_reads_old_shards():
    batch = make_batch(rollouts.to_table(_rows()), TOK.pad_id)
    # sample 0: prompt of 4 -> completion targets start at index 3; environment tokens at 5..7
    assert batch.loss_mask[0].tolist()[:10] == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert batch.loss_mask[1].tolist()[3:6] == [1, 1, 1]
    old = rollouts.to_table(_rows()).drop_columns(["completion_mask", "turn_policy_versions"])
    assert make_batch(old, TOK.pad_id).loss_mask[0].sum() == 7  # no column: every completion token trained


def test_packed_loss_equals_padded_loss_with_environment_tokens():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48), 50)
    batch = make_batch(rollouts.to_table(_rows()), TOK.pad_id)
    packed = pack_batch(batch, TOK.pad_id)
    objective = Objective(TrainerConfig(loss={"type": "tis", "cap": 1e9}))  # keeps every token: loss non-zero
    counts = counts_of(batch)
    padded, padded_stats = objective(token_scores(batch, batch_logprobs(model, batch)), counts)
    pk, pk_stats = objective(token_scores(packed, packed_logprobs(model, packed)), counts)
    assert padded_stats["tokens"] == pk_stats["tokens"] == 7 and padded != 0
    assert torch.allclose(padded, pk, atol=1e-6)


def test_sft_batch_trains_replies_of_multi_turn_envs():
    from engines.trainer.sft import sft_batch

    mix = EnvMix([EnvSpec(name="tool-lookup", min_chars=3, max_chars=4)], seed=0)
    ids, mask = sft_batch(mix, TOK, 1, 4)
    for row, m in zip(ids.tolist(), mask.tolist(), strict=True):
        trained = TOK.decode([t for t, keep in zip(row[1:], m, strict=True) if keep], skip_special=False)
        assert trained.startswith("?") and trained.count("<eos>") == 2


CHATML = (
    "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)


def test_hf_continuation_equals_the_template_rendering_of_the_whole_conversation(tmp_path):
    """A ChatML-like template (text after the assistant's eos): sampled ids + continuation == full render."""
    import json

    from engines.models.tokenizer import HFTokenizer

    TOK.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    hf = HFTokenizer(tmp_path)
    user, tool = {"role": "user", "content": "get:ab"}, {"role": "tool", "content": "is:xyz"}
    sampled = hf.encode("?ab", bos=False) + [hf.eos_id]
    ids = hf.render_prompt(user["content"]) + sampled + hf.render_continuation([tool])
    assert ids == hf.render_messages([user, {"role": "assistant", "content": "?ab"}, tool])
    assert hf.decode(hf.render_continuation([tool]), skip_special=False) == " <bos>tool:is:xyz<eos> <bos>assistant:"
    no_eos = "{{ messages[0]['content'] }}"  # never closes an assistant turn with the eos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": no_eos}))
    with pytest.raises(ValueError, match="does not end an assistant turn"):
        HFTokenizer(tmp_path).render_continuation([tool])


@pytest.mark.parametrize("header", ["X-Session-ID", "X-Rollout"])
def test_every_request_of_an_episode_carries_its_session_header_over_http(header):
    """post_completion over a real loopback socket: the server sees the episode's id in the session header
    (the default, or the one inference.router.session_header configures), and no other session header."""
    import httpx

    from engines.orchestrator.multiturn import post_completion
    from engines.protocol import CompletionResponse, Usage

    body = CompletionResponse(
        id="c",
        created=0,
        model="m",
        choices=[_choice("?ab", 3)],
        usage=Usage(prompt_tokens=1, completion_tokens=4, total_tokens=5),
    ).model_dump_json()
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)}
        await reader.readexactly(int(headers["content-length"]))
        seen.append({k: v for k, v in headers.items() if k in ("x-session-id", "x-rollout")})
        writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        )
        writer.write(body.encode())
        await writer.drain()
        writer.close()

    async def main() -> list[CompletionChoice]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        limit = asyncio.Semaphore(2)
        request = CompletionRequest(prompt=[1, 2], max_tokens=4)
        async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            sid = "run/s000001-g0000-03"
            return [(await post_completion(client, limit, request, sid, header)).choices[0] for _ in range(2)]

    choices = asyncio.run(main())
    assert seen == [{header.lower(): "run/s000001-g0000-03"}] * 2
    assert choices[0].token_ids == TOK.encode("?ab", bos=False) + [TOK.eos_id]
