"""Supervised fine-tuning's data path without a run: conversations rendered with an assistant-only mask,
packing, bad rows refused or counted, the formats, the lake source, shuffled epochs and the `rollflow sft`
command line up to the flow (an S3 dataset and whole runs: tests/integration/test_sft_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from config.model import ModelConfig
from config.run import RunConfig
from config.sft import FileData, LakeData, SFTConfig
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer, HFTokenizer, render_conversation
from engines.trainer.batch import pack_batch
from engines.trainer.common import train_logprobs
from engines.trainer.sft import to_batch
from engines.trainer.sft_data import Dataset, Sample, Stream, load_files, load_lake
from engines.trainer.sft_files import DataError
from rollflow.cli import main as cli_main
from storage.fs import get_fs
from tests.unit.test_episodes import CHATML
from tests.unit.test_lake import _lake

TOK = CharTokenizer()
SYSTEM = {"role": "system", "content": "be brief. "}
CHAT = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
MULTI = [
    *CHAT,
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "yo yo"},
    {"role": "user", "content": "bye"},
]


def _trained(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special=False)


def test_every_assistant_turn_is_trained_and_nothing_else():
    ids, mask = render_conversation(TOK, MULTI)
    assert _trained(TOK, ids, mask) == "yo<eos>yo yo<eos>"
    # system and user text, the template's turn openings: masked; the trailing user turn: left out
    assert TOK.decode([t for t, m in zip(ids, mask, strict=True) if not m]) == "be brief. hi=again="
    assert ids[: mask.index(1)] == TOK.render_messages(CHAT[:2])  # what the engine is prompted with


def test_a_chat_template_renders_the_conversation_the_model_is_prompted_with(tmp_path):
    TOK.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    hf = HFTokenizer(tmp_path)
    ids, mask = render_conversation(hf, MULTI)
    assert _trained(hf, ids, mask) == "yo<eos>yo yo<eos>"
    second = len(ids) - mask[::-1].index(0)  # where the last assistant turn starts
    assert ids[:second] == hf.render_messages(MULTI[:4])  # the whole history through the template
    assert hf.decode(ids[:second], skip_special=False).endswith("<bos>user:again<eos> <bos>assistant:")


def test_packed_rows_train_the_same_tokens_to_the_same_loss():
    torch.manual_seed(0)
    shape = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model = CausalLM(shape, TOK.vocab_size)
    samples = [Sample(*render_conversation(TOK, c)) for c in (CHAT, MULTI, CHAT[1:], MULTI[:5])]
    batch = to_batch(samples, TOK.pad_id)
    packed = pack_batch(batch, TOK.pad_id, 64)
    assert len(packed) < len(batch) and packed.loss_mask.sum() == batch.loss_mask.sum() == 3 + 9 + 3 + 9
    loss = [-(train_logprobs(model, b) * b.loss_mask).sum() for b in (batch, packed)]
    assert torch.allclose(loss[0], loss[1], atol=1e-5)


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


BAD = {
    "missing_column": {"msgs": CHAT},
    "no_assistant_turn": {"messages": CHAT[:2]},
    "unknown_role": {"messages": [{"role": "narrator", "content": "x"}, *CHAT]},
    "too_long": {"messages": [{"role": "user", "content": "a" * 80}, CHAT[2]]},
    "not_json": "{not json",
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_a_bad_row_is_refused_naming_the_file_and_row(tmp_path, reason):
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, BAD[reason]])
    with pytest.raises(DataError, match=rf"{path}: row 2\b.*on_bad_row = 'skip'"):
        load_files(FileData(path=path), TOK, 64, get_fs(path)[0])


def test_bad_rows_are_skipped_and_counted_with_skip(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, *BAD.values(), {"messages": MULTI}])
    data = load_files(FileData(path=path, on_bad_row="skip"), TOK, 64, get_fs(path)[0])
    assert len(data.samples) == 2
    assert data.report["skipped"] == {reason: 1 for reason in BAD}
    assert data.report["rows"] == 7 and data.report["trained_tokens"] == 3 + 9


def _save_to_disk(directory: Path, table: pa.Table) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes (datasets is not installed here): Arrow stream files
    listed in state.json, beside dataset_info.json."""
    directory.mkdir()
    with pa.ipc.new_stream(directory / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "f", "_split": None}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}))


def test_parquet_arrow_and_a_saved_hf_dataset_read_like_jsonl(tmp_path):
    conversations = [CHAT, MULTI, CHAT[1:]]
    table = pa.table({"conv": conversations, "id": [1, 2, 3]})
    pq.write_table(table.slice(0, 2), tmp_path / "a.parquet")
    with pa.ipc.new_file(tmp_path / "b.arrow", table.schema) as writer:
        writer.write_table(table.slice(2))
    _save_to_disk(tmp_path / "hf", table)
    expected = [render_conversation(TOK, c) for c in conversations]
    for path in (str(tmp_path / "*.*"), str(tmp_path / "hf")):
        data = load_files(FileData(path=path, messages_column="conv"), TOK, 64, get_fs(path)[0])
        assert [(s.ids, s.mask) for s in data.samples] == [(list(i), list(m)) for i, m in expected]
    with pytest.raises(DataError, match=r"a\.parquet: row 1 \(column 'messages'\)"):
        load_files(FileData(path=str(tmp_path / "a.parquet")), TOK, 64, get_fs(str(tmp_path))[0])


def test_the_lake_source_filters_rollouts_and_trains_completion_tokens(tmp_path):
    run = _lake(tmp_path, images=False)  # 4 steps x rewards 0, .25, .5, .75; completions [10], [10, 11], ...
    spec = LakeData(run=run, steps="2:3", min_reward=0.5)
    data = load_lake(spec, TOK, 64, None)
    assert data.report["samples"] == 4  # steps 2 and 3, rewards .5 and .75
    for s in data.samples:
        assert s.ids[:5] == [1, 20, 21, 22, 5] and s.mask == [0] * 5 + [1] * (len(s.ids) - 5)
    texts = load_lake(spec.model_copy(update={"tokens": "text", "limit": 1}), TOK, 64, None)
    (sample,) = texts.samples
    assert _trained(TOK, sample.ids, sample.mask) == "cba<eos>"  # step 2, reward .5: completion_text "cba"
    with pytest.raises(DataError, match=r"no usable sample"):
        load_lake(LakeData(run=run, env="sort-letters"), TOK, 64, None)


def test_epochs_are_seeded_permutations_and_a_resume_must_read_the_same_data():
    data = Dataset([Sample([i], [1]) for i in range(5)], {})
    stream = Stream(data, seed=3)
    seen = [s.ids[0] for s in stream.take(10)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5)) and seen[:5] != seen[5:]
    again = Stream(data, seed=3)
    again.load_state_dict(stream.state_dict())
    assert [s.ids for s in again.take(3)] == [s.ids for s in Stream(data, seed=3).take(13)[10:]]
    assert stream.steps_for(epochs=3, batch_size=4) == 4
    with pytest.raises(DataError, match="another dataset"):
        Stream(Dataset(data.samples[:4], {}), 3).load_state_dict(stream.state_dict())


def test_config_infers_the_source_and_refuses_epochs_without_a_dataset():
    assert SFTConfig(data={"path": "x.jsonl"}).data.type == "files"
    assert SFTConfig(data={"run": "outputs/a", "steps": "3:"}).data.type == "lake"
    assert SFTConfig().data.type == "envs"
    with pytest.raises(ValueError, match="endless stream"):
        SFTConfig(epochs=2)
    with pytest.raises(ValueError, match="expected N, A:B"):
        LakeData(run="r", steps="a:b")


def test_cli_dry_run_writes_the_sft_config_and_refuses_a_missing_path(tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    out = tmp_path / "run"
    assert cli_main(["sft", "--output-dir", str(out), "--sft.data.path", data, "--dry-run"]) == 0
    sft = json.loads((out / "config" / "sft.json").read_text())
    assert sft["sft"]["data"]["path"] == data and sft["sft_run"]["checkpoint"]["interval"] == 5
    stored = json.loads((out / "config" / "run.json").read_text())
    assert RunConfig.model_validate({k: v for k, v in stored.items() if k != "run_id"}).sft.data.type == "files"
    missing = str(tmp_path / "nope.jsonl")
    assert cli_main(["sft", "--output-dir", str(out), "--sft.data.path", missing, "--dry-run"]) == 2
    assert f"{missing!r}: no such file" in capsys.readouterr().err
