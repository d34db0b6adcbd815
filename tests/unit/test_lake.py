"""The rollout lake on a local folder: `rollflow lake` (report, export, plots, corrupt data), and reading
it with pyarrow.dataset, Polars and pandas with hive partitioning by step, MoE routing payload included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from rollflow.cli import main as cli_main
from storage import lake, rollouts
from storage.fs import get_fs
from tests.unit.test_rollouts import _rows

LAYERS, TOP_K = 3, 2


def _routing(row: dict) -> list:
    """[seq, layers, top_k] expert ids, seq = prompt + completion - 1 (every position run through the model)."""
    seq = len(row["prompt_ids"]) + len(row["completion_ids"]) - 1
    return [[[(t + layer + k) % 8 for k in range(TOP_K)] for layer in range(LAYERS)] for t in range(seq)]


def _lake(tmp_path: Path, steps=(1, 2, 3, 4), moe: bool = False, images: bool = True) -> str:
    out = str(tmp_path / "run")
    fs, root = get_fs(out)
    for s in steps:
        rows = _rows(s, n=4, images=images)
        for r in rows:
            r["routed_experts"] = _routing(r) if moe else None
        versions: dict[int, int] = {}
        for r in rows:
            versions[r["policy_version"]] = versions.get(r["policy_version"], 0) + 1
        rollouts.write_step(fs, root, s, rollouts.to_table(rows), {"gen_s": 0.1, "dropped": 0, "versions": versions})
    return out


def test_report_by_step_version_and_staleness(tmp_path):
    out = _lake(tmp_path)
    report = lake.inspect(out)
    assert report["rollout_steps"] == [1, 2, 3, 4]
    assert report["samples"] == 16
    # _rows: rewards 0, .25, .5, .75 in every step; policy_version = max(step - 2, 0)
    assert report["by_step"][3]["reward_mean"] == pytest.approx(0.375)
    assert report["by_step"][3]["completion_len_mean"] == pytest.approx((1 + 2 + 3 + 3) / 4)
    assert report["by_policy_version"][0]["samples"] == 8  # steps 1 and 2
    assert report["staleness_histogram"] == {0: 4, 1: 12}  # step 1: 0; steps 2-4: 1
    assert report["errors"] == [] and report["uncommitted_step_dirs"] == []
    text = lake.render(report)
    assert "rollout steps committed: 4 (1..4); samples: 16" in text


def test_cli_reports_a_corrupted_shard_with_its_path_and_exits_1(tmp_path, capsys):
    out = _lake(tmp_path)
    shard = tmp_path / "run" / "rollouts" / "step=000002" / "part-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "run" / "rollouts" / "step=000005").mkdir()  # a crash before its manifest
    assert cli_main(["lake", out]) == lake.EXIT_CORRUPT
    printed = capsys.readouterr().out
    assert str(shard) in printed and "checksum mismatch" in printed
    assert "step=000005" in printed  # uncommitted folders are named, not read
    assert "rollout steps committed: 4" in printed  # the corrupted step is committed, and reported


def test_cli_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli_main(["lake", str(tmp_path)]) == lake.EXIT_USAGE
    assert "not a rollflow run" in capsys.readouterr().err


def test_export_selected_samples_as_jsonl(tmp_path):
    out = _lake(tmp_path)
    path = tmp_path / "sel.jsonl"
    assert cli_main(["lake", out, "--export", str(path), "--steps", "2:3", "--min-reward", "0.5"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and {r["step"] for r in rows} == {2, 3} and min(r["reward"] for r in rows) >= 0.5
    assert set(rows[0]) == set(rollouts.ROLLOUT_SCHEMA.names)
    assert lake.export(out, str(path), limit=3) == 3
    with pytest.raises(ValueError, match="--steps"):
        lake.parse_steps("a:b")


def test_plot_writes_png_charts(tmp_path):
    out = _lake(tmp_path)
    paths = lake.plot(lake.inspect(out), str(tmp_path / "plots"))
    # _rows' samples carry (undecodable) images: the contact sheet shows them as grey squares
    assert [Path(p).name for p in paths] == ["reward_by_step.png", "staleness.png", "samples.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_standard_readers_see_every_committed_sample_with_hive_steps(tmp_path):
    out = _lake(tmp_path, moe=True)
    table = ds.dataset(f"{out}/rollouts", format="ipc", partitioning="hive").to_table()
    assert table.num_rows == 16
    assert sorted(set(table.column("step").to_pylist())) == [1, 2, 3, 4]
    pl = pytest.importorskip("polars")
    df = pl.scan_ipc(f"{out}/rollouts/**/*.arrow", hive_partitioning=True).collect()
    assert df.height == 16 and df["step"].unique().sort().to_list() == [1, 2, 3, 4]
    pd = pytest.importorskip("pandas")
    pdf = table.to_pandas()
    assert isinstance(pdf, pd.DataFrame) and pdf.groupby("step").size().to_list() == [4, 4, 4, 4]


def test_routed_experts_payload_replays_as_seq_layers_topk(tmp_path):
    out = _lake(tmp_path, steps=(1,), moe=True)
    table = ds.dataset(f"{out}/rollouts", format="ipc", partitioning="hive").to_table()
    row = table.slice(2, 1).to_pylist()[0]
    routing = np.array(row["routed_experts"], dtype=np.int16)
    assert routing.shape == (len(row["prompt_ids"]) + len(row["completion_ids"]) - 1, LAYERS, TOP_K)
    assert routing.tolist() == _routing(row)


def test_routed_experts_of_the_wrong_shape_are_refused():
    rows = _rows(1, n=2)
    for r in rows:
        r["routed_experts"] = _routing(r)
    rows[1]["routed_experts"] = rows[1]["routed_experts"][:-1]
    with pytest.raises(ValueError, match="s000001-g0000-01"):
        rollouts.to_table(rows)
    rows[1]["routed_experts"] = _routing(rows[1])
    rows[1]["routed_experts"][0][0] = [1, 2, 3]  # top_k 3 in one token
    with pytest.raises(ValueError, match="top_k"):
        rollouts.to_table(rows)


def test_verify_checks_weights_and_checkpoints_and_names_the_bad_one(tmp_path, capsys):
    import torch

    from storage import checkpoints, weights

    out = _lake(tmp_path)
    fs, root = get_fs(out)
    for v in range(3):
        weights.publish(fs, root, v, {"w": torch.full((8,), float(v))})
    checkpoints.save(fs, root, 2, "trainer", {"model.safetensors": b"m" * 64, "optimizer.pt": b"o" * 64})
    assert cli_main(["lake", out, "--verify"]) == 0
    assert "verified weight and checkpoint files: 5" in capsys.readouterr().out
    bad = tmp_path / "run" / "checkpoints" / "step=000002" / "trainer" / "optimizer.pt"
    bad.write_bytes(b"o" * 63)
    assert cli_main(["lake", out, "--verify"]) == lake.EXIT_CORRUPT
    assert str(bad) in capsys.readouterr().out


def test_eval_rows_of_metrics_are_reported_and_plotted(tmp_path, capsys):
    out = _lake(tmp_path)
    rows = [{"step": 0, "eval/reward_mean": 0.1, "eval/rev/pass@2": 0.25}]  # version 0: evaluation keys only
    rows += [{"step": s, "reward_mean": 0.375, "eval/reward_mean": s / 8} for s in (2, 4)]
    rows += [{"step": s, "reward_mean": 0.375} for s in (1, 3)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = lake.inspect(out)
    assert report["eval"] == {"eval/reward_mean": [(0, 0.1), (2, 0.25), (4, 0.5)], "eval/rev/pass@2": [(0, 0.25)]}
    assert cli_main(["lake", out, "--plot", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    assert "held-out evaluation (metrics.jsonl) by step:" in printed
    assert printed.rstrip().endswith("4             0.500                -")
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["eval_by_step.png", "reward_by_step.png", "samples.png", "staleness.png"]
    assert (tmp_path / "plots" / "eval_by_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n{"reward_mean"\n')
    assert cli_main(["lake", out]) == lake.EXIT_CORRUPT
    assert f"{tmp_path / 'run' / 'metrics.jsonl'}: unreadable: JSONDecodeError" in capsys.readouterr().out
