"""Durable storage: rollout shards (manifest-last, checksummed, hive-readable), weights, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch

from storage import rollouts, weights
from storage.fs import MANIFEST, CorruptError, get_fs, step_dir
from storage.metrics import MetricsLog, read_metrics
from storage.rollouts import ROLLOUT_SCHEMA, committed_rollout_steps, read_step, to_table, write_step


def _rows(step: int, n: int = 3, images: bool = True) -> list[dict]:
    """`n` samples of `step`; with `images`, sample k carries k (undecodable) images."""
    rows = []
    for k in range(n):
        group_id = f"s{step:06d}-g0000"
        completion = [10 + k, 11, 2][: 1 + k]
        rows.append(
            {
                "run_id": "run-1",
                "step": step,
                "sample_id": f"{group_id}-{k:02d}",
                "group_id": group_id,
                "env": "reverse-text",
                "policy_version": max(step - 2, 0),
                "policy_version_end": step - 1,
                "prompt_ids": [1, 20, 21, 22, 5],
                "completion_ids": completion,
                "completion_logprobs": [-0.5 - 0.25 * i for i in range(len(completion))],
                "reward": 0.25 * k,
                "advantage": 0.5 * k - 0.5,
                "temperature": 1.0,
                "finish_reason": "stop" if k == 2 else "length",
                "prompt_text": "rev:abc=",
                "completion_text": "cba"[: 1 + k],
                "routed_experts": None,
                "completion_mask": None,
                "turn_policy_versions": None,
                "turn_policy_versions_end": None,
                "metric_names": ["reward/exact", "metric/len"] if k else None,
                "metric_values": [0.5 * k, float(k)] if k else None,
                "completion_kept": [40 - i for i in range(len(completion))] if k else None,
                "teacher_logprobs": [-1.0 - 0.5 * i for i in range(len(completion))] if k else None,
                "token_advantages": [0.25 * i - 0.5 for i in range(len(completion))] if k else None,
                "images": [bytes([k]) * (8 + i) for i in range(k * images)] or None,  # the lake does not decode
                "image_sha256": rollouts.image_digests([bytes([k]) * (8 + i) for i in range(k * images)]) or None,
            }
        )
    return rows


def _setup(tmp_path, steps=(1, 2, 3)):
    fs, root = get_fs(str(tmp_path / "run"))
    written = {}
    for s in steps:
        rows = _rows(s, n=2 + s)
        write_step(fs, root, s, to_table(rows), {"gen_s": 0.1 * s})
        written[s] = rows
    return fs, root, written


def _shard(root: str, step: int) -> str:
    return f"{step_dir(rollouts.rollouts_root(root), step)}/part-00000.arrow"


def test_rows_cover_the_schema():
    assert set(_rows(1)[0]) == set(ROLLOUT_SCHEMA.names)


def test_write_read_round_trip(tmp_path):
    fs, root, written = _setup(tmp_path)
    assert committed_rollout_steps(fs, root) == [1, 2, 3]
    for s, rows in written.items():
        table, manifest = read_step(fs, root, s)
        assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=True)
        assert table.num_rows == len(rows)
        back = table.to_pylist()
        for got, want in zip(back, rows, strict=True):
            assert got.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, float) or key == "completion_logprobs":  # stored as float32
                    assert got[key] == pytest.approx(value)
                else:
                    assert got[key] == value, key
        assert manifest["step"] == s and manifest["rows"] == len(rows)
        assert manifest["gen_s"] == pytest.approx(0.1 * s)
        assert manifest["schema_version"] == rollouts.SCHEMA_VERSION
        assert set(manifest["files"]) == {"part-00000.arrow"}


def test_to_table_fills_missing_optional_with_null_and_rejects_missing_required():
    rows = _rows(1)
    for r in rows:
        del r["routed_experts"]
    assert to_table(rows).column("routed_experts").null_count == len(rows)
    rows[0].pop("reward")
    with pytest.raises(ValueError, match="reward"):
        to_table(rows)


def test_write_step_casts_to_schema(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"))
    table = to_table(_rows(4))
    loose = pa.Table.from_pylist(table.to_pylist())  # inferred types: int64 lists, double, nullable
    assert not loose.schema.equals(ROLLOUT_SCHEMA)
    write_step(fs, root, 4, loose, {})
    back, _ = read_step(fs, root, 4)
    assert back.schema.equals(ROLLOUT_SCHEMA)
    assert back.column("prompt_ids").to_pylist() == table.column("prompt_ids").to_pylist()


def test_pyarrow_hive_dataset_reads_committed_rows(tmp_path):
    fs, root, written = _setup(tmp_path)
    dataset = ds.dataset(f"{root}/rollouts", format="ipc", partitioning="hive")
    assert all(MANIFEST not in f for f in dataset.files)
    assert len(dataset.files) == 3
    table = dataset.to_table()
    assert table.num_rows == sum(len(r) for r in written.values())
    steps = table.column("step").to_pylist()
    ids = table.column("sample_id").to_pylist()
    expected = {r["sample_id"]: r["step"] for rows in written.values() for r in rows}
    assert dict(zip(ids, steps, strict=True)) == expected
    # partition filter works on the hive key
    only2 = dataset.to_table(filter=ds.field("step") == 2)
    assert sorted(only2.column("sample_id").to_pylist()) == sorted(r["sample_id"] for r in written[2])


def test_polars_and_pandas_read_a_shard(tmp_path):
    fs, root, written = _setup(tmp_path, steps=(2,))
    path = _shard(root, 2)
    pl = pytest.importorskip("polars")
    df = pl.read_ipc(path)
    assert df.height == len(written[2])
    assert df["sample_id"].to_list() == [r["sample_id"] for r in written[2]]
    assert df["completion_ids"].to_list() == [r["completion_ids"] for r in written[2]]
    pd = pytest.importorskip("pandas")
    pdf = pd.read_feather(path)
    assert list(pdf["step"]) == [2] * len(written[2])
    assert list(pdf["reward"]) == pytest.approx([r["reward"] for r in written[2]])


def test_corrupted_shard_raises_with_path(tmp_path):
    fs, root, _ = _setup(tmp_path, steps=(1,))
    path = _shard(root, 1)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptError) as exc:
        read_step(fs, root, 1)
    assert path in str(exc.value)


def test_truncated_shard_raises_with_path(tmp_path):
    fs, root, _ = _setup(tmp_path, steps=(1,))
    path = _shard(root, 1)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 17])
    with pytest.raises(CorruptError) as exc:
        read_step(fs, root, 1)
    assert path in str(exc.value)


def test_missing_shard_and_bad_manifest_raise(tmp_path):
    fs, root, _ = _setup(tmp_path, steps=(1, 2))
    Path(_shard(root, 1)).unlink()
    with pytest.raises(CorruptError, match="part-00000.arrow"):
        read_step(fs, root, 1)
    manifest = f"{step_dir(rollouts.rollouts_root(root), 2)}/{MANIFEST}"
    with open(manifest, "w") as f:
        f.write("{not json")
    with pytest.raises(CorruptError, match=MANIFEST):
        read_step(fs, root, 2)


def test_step_without_manifest_is_not_committed(tmp_path):
    fs, root, _ = _setup(tmp_path, steps=(1, 2))
    # a crash between the shard and the manifest leaves step 3 half written
    d3 = step_dir(rollouts.rollouts_root(root), 3)
    fs.makedirs(d3, exist_ok=True)
    Path(f"{d3}/part-00000.arrow").write_bytes(b"partial")
    fs.makedirs(step_dir(rollouts.rollouts_root(root), 4), exist_ok=True)
    assert committed_rollout_steps(fs, root) == [1, 2]
    write_step(fs, root, 3, to_table(_rows(3)), {})
    assert committed_rollout_steps(fs, root) == [1, 2, 3]


def test_no_temp_files_left_behind(tmp_path):
    fs, root, _ = _setup(tmp_path, steps=(1,))
    names = sorted(p.name for p in (tmp_path / "run" / "rollouts" / "step=000001").iterdir())
    assert names == [MANIFEST, "part-00000.arrow"]


def test_committed_steps_empty_when_nothing_written(tmp_path):
    fs, root = get_fs(str(tmp_path / "empty"))
    assert committed_rollout_steps(fs, root) == []
    assert weights.latest_version(fs, root) is None


def test_weights_publish_latest_load_round_trip(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"))
    g = torch.Generator().manual_seed(0)
    states = {
        v: {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g).to(torch.bfloat16)}
        for v in (0, 1, 2)
    }
    dirs = {v: weights.publish(fs, root, v, sd) for v, sd in states.items()}
    assert weights.latest_version(fs, root) == 2
    for v, sd in states.items():
        back = weights.load(fs, dirs[v])
        assert back.keys() == sd.keys()
        for k in sd:
            assert back[k].dtype == sd[k].dtype
            assert torch.equal(back[k], sd[k])
    assert dirs[2] == step_dir(weights.weights_root(root), 2)
    # an unfinished publication (no manifest) is not the latest
    fs.makedirs(step_dir(weights.weights_root(root), 3), exist_ok=True)
    assert weights.latest_version(fs, root) == 2
    # nor is a folder rollflow did not write, whatever its name
    for name in ("step=9x", "notes", "step=-1"):
        fs.makedirs(f"{weights.weights_root(root)}/{name}", exist_ok=True)
        fs.pipe_file(f"{weights.weights_root(root)}/{name}/_manifest.json", b"{}")
    assert weights.latest_version(fs, root) == 2
    # a corrupted publication is refused
    path = f"{dirs[1]}/{weights.WEIGHTS_FILE}"
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0x01
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptError, match=weights.WEIGHTS_FILE):
        weights.load(fs, dirs[1])


def test_weights_publish_tied_model_state_dict(tmp_path):
    from config.model import ModelConfig
    from engines.models.decoder import CausalLM

    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48)
    src, dst = CausalLM(cfg, 20), CausalLM(cfg, 20)
    fs, root = get_fs(str(tmp_path / "run"))
    d = weights.publish(fs, root, 0, src.publishable_state_dict())
    dst.load_published(weights.load(fs, d))
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()  # still tied


def test_metrics_log_one_row_per_step(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"))
    log = MetricsLog(fs, root)
    log.record({"step": 2, "loss": 0.5})
    log.record({"step": 1, "loss": 0.9})
    log.record({"step": 2, "loss": 0.4})  # re-recorded (e.g. after a restart): replaces
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 0.9}, {"step": 2, "loss": 0.4}]
    # a new log (a restarted trainer) picks up the rows and keeps de-duplicating
    log2 = MetricsLog(fs, root)
    log2.record({"step": 1, "loss": 0.8})
    log2.record({"step": 3, "loss": 0.3})
    assert read_metrics(fs, root) == [{"step": 1, "loss": 0.8}, {"step": 2, "loss": 0.4}, {"step": 3, "loss": 0.3}]


def test_metric_means_average_each_rubric_name_over_the_rows_that_carry_it():
    table = to_table(_rows(1))  # rows k=1, 2 carry scores, k=0 none
    assert rollouts.metric_means(table) == {"env/metric/len": 1.5, "env/reward/exact": 0.75}
    assert rollouts.metric_means(table.drop_columns(["metric_names", "metric_values"])) == {}


def test_metrics_log_appends_new_steps_and_rewrites_only_to_change_one(tmp_path):
    fs, root = get_fs(str(tmp_path / "run"))
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(fs, root)
    log.record({"step": 1, "loss": 1.0})
    inode = path.stat().st_ino
    for step in range(2, 40):
        log.record({"step": step, "loss": 1.0 / step})
    assert path.stat().st_ino == inode and not hasattr(log, "_rows")  # appended in place; no rows held
    log.record({"step": 5, "loss": 0.0})  # a step again: the file is written anew, atomically
    assert path.stat().st_ino != inode
    assert [r["step"] for r in read_metrics(fs, root)] == list(range(1, 40)) and log.row(5) == {"step": 5, "loss": 0.0}
    with path.open("ab") as f:
        f.write(b'{"step": 40, "lo')  # an append cut short by a crash
    assert [r["step"] for r in read_metrics(fs, root)][-1] == 39  # readers take complete lines only
    again = MetricsLog(fs, root)
    again.record({"step": 40, "loss": 0.025})
    assert path.read_bytes().endswith(b'{"step": 40, "loss": 0.025}\n')
    assert [r["step"] for r in read_metrics(fs, root)] == list(range(1, 41))
