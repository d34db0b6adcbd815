"""Kill-and-resume of a vision-language run: profiles/tiny-vlm-cpu.toml (the tiny Qwen3-VL on count-shapes, here with
one and two images) through the real `rollflow rl` flow, its orchestrator, trainer, inference server and then the
whole process tree SIGKILLed mid-run, resumed, and audited as the text runs are (tests/soak/audit.py: nothing lost or
duplicated); every committed sample still carries its images, matching their checksums."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pyarrow.dataset as ds
import pytest
from conftest import ROOT, start_cli

from tests.integration.test_resume import RESUME, _assert_nothing_lost_or_duplicated, _kill, _wait_for_step, _wait_gone
from tests.soak.audit import committed_rollouts
from tests.vlm_fixture import tiny_vlm_dir  # noqa: F401 (a fixture)

ENVS = '[{id = "count-shapes", name = "one"}, {id = "count-shapes", name = "two", args = {images = 2}}]'


@pytest.mark.long
def test_a_killed_vision_language_run_resumes_and_loses_nothing(tmp_path, prefect_api, tiny_vlm_dir):  # noqa: F811
    out, log = tmp_path / "run", tmp_path / "cli.log"
    profile = ROOT / "profiles" / "tiny-vlm-cpu.toml"
    args = ("rl", "@", str(profile), "@", str(RESUME), "--model.path", str(tiny_vlm_dir))
    args = (*args, "--envs", ENVS, "--sft.steps", "10", "--eval.interval", "0", "--output-dir", str(out))
    cli = start_cli(tmp_path, log, prefect_api, *args)
    snapshots: dict[int, str] = {}
    try:
        for point, target in ((2, "orchestrator"), (4, "trainer"), (6, "inference"), (8, "tree")):
            _wait_for_step(cli, out, point)
            time.sleep(0.3)  # into the next step: mid-generation or mid-training
            snapshots.update(committed_rollouts(out))
            cli = _kill(cli, out, target, log, prefect_api)
        assert cli.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    _assert_nothing_lost_or_duplicated(out, 10, snapshots)
    _wait_gone(out)
    table = ds.dataset(out / "rollouts", format="ipc", partitioning="hive").to_table()
    rows = table.select(["env", "images", "image_sha256"]).to_pylist()
    assert {r["env"]: len(r["images"]) for r in rows} == {"one": 1, "two": 2}
    assert all([hashlib.sha256(b).hexdigest() for b in r["images"]] == r["image_sha256"] for r in rows)
