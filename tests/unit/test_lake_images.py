"""Images in the lake: a sample's images travel in its shard (list<binary>) with their sha256, read back with
pyarrow and PIL alone, a changed image is caught, version-4 shards (no image columns) still read, and
`rollflow lake` lists image counts and draws a contact sheet of samples."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
from PIL import Image

from engines.environments.shapes import count_shapes
from rollflow.lake import main as lake_main
from storage import rollouts
from storage.fs import commit_dir, get_fs
from storage.rollouts import RolloutRow, read_step, to_table, verified_images, write_step


def _row(step: int, k: int, images: tuple[bytes, ...], reward: float) -> RolloutRow:
    group_id = rollouts.group_id(step, 0)
    return RolloutRow(
        run_id="run-img",
        step=step,
        sample_id=rollouts.sample_id(group_id, k),
        group_id=group_id,
        env="count-shapes",
        policy_version=step - 1,
        policy_version_end=step - 1,
        prompt_ids=[1, 5, 6, 6, 6, 6, 7, 8],
        completion_ids=[9, 2],
        completion_logprobs=[-0.5, -0.125],
        reward=reward,
        temperature=1.0,
        finish_reason="stop",
        prompt_text="count",
        completion_text=str(k),
        images=list(images) or None,
        image_sha256=rollouts.image_digests(images) or None,
    )


def _lake(tmp_path, steps: int = 2) -> tuple[str, list[RolloutRow]]:
    out = str(tmp_path / "run")
    fs, root = get_fs(out)
    env, two = count_shapes(), count_shapes(images=2)
    written = []
    for step in range(1, steps + 1):
        rng = random.Random(step)
        rows = [_row(step, 0, (), 0.0)]  # a text-only sample beside the image ones
        rows += [_row(step, k, env.sample(rng).images, 0.25 * k) for k in (1, 2)]
        rows.append(_row(step, 3, two.sample(rng).images, 1.0))
        write_step(fs, root, step, to_table(rows), {"gen_s": 0.1, "dropped": 0, "versions": {}})
        written += rows
    return out, written


PYARROW_ONLY = textwrap.dedent(
    """
    import hashlib, io, json, sys
    import pyarrow.dataset as ds
    from PIL import Image
    table = ds.dataset(sys.argv[1], format="ipc", partitioning="hive").to_table()
    out = []
    for row in table.select(["sample_id", "images", "image_sha256"]).to_pylist():
        for data, sha in zip(row["images"] or [], row["image_sha256"] or []):
            assert hashlib.sha256(data).hexdigest() == sha, row["sample_id"]
            out.append([row["sample_id"], Image.open(io.BytesIO(data)).size])
    assert not any(m.startswith(("storage", "engines", "rollflow")) for m in sys.modules)
    print(json.dumps(out))
    """
)


def test_images_round_trip_and_read_with_pyarrow_and_pil_alone(tmp_path):
    out, written = _lake(tmp_path)
    fs, root = get_fs(out)
    table, manifest = read_step(fs, root, 1)
    assert manifest["schema_version"] == rollouts.SCHEMA_VERSION >= 5
    assert table.schema.field("images").type == pa.list_(pa.binary())
    back = [RolloutRow.model_validate(r) for r in table.to_pylist()]
    assert back == [r for r in written if r.step == 1]
    proc = subprocess.run(
        [sys.executable, "-c", PYARROW_ONLY, f"{out}/rollouts"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert len(seen) == sum(len(r.images or []) for r in written) == 2 * (1 + 1 + 2)
    assert all(size == [64, 64] for _, size in seen)


def test_a_changed_image_or_a_missing_checksum_is_refused():
    images = count_shapes().sample(random.Random(0)).images
    row = _row(1, 0, images, 1.0)
    assert verified_images(row.images, row.image_sha256, row.sample_id) == list(images)
    assert verified_images(None, None, "x") == []
    flipped = bytes([images[0][0] ^ 1]) + images[0][1:]
    with pytest.raises(ValueError, match="s000001-g0000-00: image 0 .* does not match"):
        verified_images([flipped], row.image_sha256, row.sample_id)
    with pytest.raises(ValueError, match="1 images but 0 image_sha256"):
        to_table([row.model_copy(update={"image_sha256": None})])


def test_a_version_4_shard_reads_as_text_only(tmp_path):
    rows = [_row(1, 0, (), 0.5)]
    v4 = pa.schema(
        [f for f in rollouts.ROLLOUT_SCHEMA if f.name not in ("images", "image_sha256")],
        metadata={b"rollflow.schema_version": b"4"},
    )
    table = to_table(rows).drop_columns(["images", "image_sha256"]).cast(v4)
    fs, root = get_fs(str(tmp_path / "run"))
    files = {"part-00000.arrow": rollouts._ipc_bytes(table)}
    commit_dir(fs, rollouts.step_path(root, 1), files, {"step": 1, "rows": 1, "schema_version": 4})
    back, manifest = read_step(fs, root, 1)
    assert manifest["schema_version"] == 4 and "images" not in back.column_names
    assert [RolloutRow.model_validate(r) for r in back.to_pylist()] == rows  # missing columns read as null


def test_lake_lists_images_and_plots_a_contact_sheet(tmp_path, capsys):
    out, written = _lake(tmp_path)
    plots = tmp_path / "plots"
    assert lake_main([out, "--plot", str(plots)]) == 0
    text = capsys.readouterr().out
    assert "images" in text and "64x64" in text
    sheet = plots / "samples.png"
    assert sheet.is_file()
    with Image.open(sheet) as img:
        assert img.width >= 4 * 64 and img.height >= 2 * 64  # thumbnails of several samples, not an empty canvas
        colors = img.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 20
    assert lake_main([out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == {
        "samples_with_images": 6,
        "images": 8,
        "per_sample": {"0": 2, "1": 4, "2": 2},
        "sizes": {"64x64": 8},
    }
    export = tmp_path / "x.jsonl"
    assert lake_main([out, "--export", str(export), "--steps", "1"]) == 0
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert [len(r["images"] or []) for r in lines] == [0, 1, 1, 2]  # base64 text in JSON


def test_a_few_samples_images_are_logged_to_mlflow_every_few_steps(tmp_path):
    from mlflow.tracking import MlflowClient

    from config.tracking import TrackingConfig
    from engines.trainer.tracking import Tracker
    from runtime.tracking import start_mlflow_run

    out, _ = _lake(tmp_path, steps=1)
    fs, root = get_fs(out)
    table, _ = read_step(fs, root, 1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = start_mlflow_run(uri, "e", "run-img", {}, {})
    client = MlflowClient(uri)
    tracker = Tracker(fs, root, uri, run_id)
    cfg = TrackingConfig(image_samples=2, image_every=5)
    assert tracker.log_samples(5, table, cfg) == "samples/step=000005.png"
    assert tracker.log_samples(6, table, cfg) is None  # not a logging step
    assert tracker.log_samples(10, table.filter(pa.array([True, False, False, False])), cfg) is None  # no images
    assert tracker.log_samples(10, table, TrackingConfig(image_samples=0)) is None
    logged = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert logged == ["samples/step=000005.png"]
    # beside the store (the run directory by default), not in the working directory's mlruns/
    assert [p.name for p in (tmp_path / "mlartifacts").rglob("*.png")] == ["step=000005.png"]
    with Image.open(client.download_artifacts(run_id, logged[0], str(tmp_path / "dl"))) as sheet:
        assert sheet.width >= 2 * 64 and sheet.height > 64  # two samples' cells, thumbnails above their text
    assert Tracker(fs, root, None, None).log_samples(5, table, cfg) is None  # MLflow off
