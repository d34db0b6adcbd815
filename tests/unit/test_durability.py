"""Durability of commits on a local disk: every committing rename is followed by an fsync of its folder (and a
new folder by an fsync of its parent), observed through the real os.fsync calls on directory descriptors; and a
stray `step=<not a number>` folder is skipped, with a warning, by every listing instead of crashing it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import torch

from runtime.slurm import write_script
from storage import checkpoints, lake, resume, rollouts, runstate, weights
from storage.fs import committed_steps, get_fs, step_dirs
from storage.metrics import MetricsLog
from tests.unit.test_rollouts import _rows


class DiskLog:
    """os.replace and os.fsync as they happen: ("replace", destination) and ("fsync-dir", folder)."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        replace, fsync = os.replace, os.fsync

        def logged_replace(src, dst, **kw):
            replace(src, dst, **kw)
            self.events.append(("replace", os.path.realpath(dst)))

        def logged_fsync(fd):
            fsync(fd)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                self.events.append(("fsync-dir", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))

        monkeypatch.setattr(os, "replace", logged_replace)
        monkeypatch.setattr(os, "fsync", logged_fsync)

    def renames_not_made_durable(self) -> list[str]:
        """Destinations whose folder was not fsynced after the rename."""
        missing = []
        for i, (kind, path) in enumerate(self.events):
            if kind == "replace" and ("fsync-dir", os.path.dirname(path)) not in self.events[i + 1 :]:
                missing.append(path)
        return missing


def test_every_committing_rename_is_followed_by_an_fsync_of_its_folder(tmp_path, monkeypatch):
    disk = DiskLog(monkeypatch)
    fs, root = get_fs(str(tmp_path / "run"))
    rollouts.write_step(fs, root, 1, rollouts.to_table(_rows(1)), {"gen_s": 0.1, "dropped": 0, "versions": {0: 3}})
    weights.publish(fs, root, 1, {"w": torch.zeros(2)})
    checkpoints.save(fs, root, 1, "trainer", {"trainer_state.pt": b"x"})
    MetricsLog(fs, root).record({"step": 1, "loss": 0.5})
    lease = runstate.acquire(fs, root, 30, settle_s=0)
    runstate.write_state(fs, root, runstate.RunState("r", None))
    runstate.renew(fs, root, lease, 30)
    write_script(tmp_path / "job.sbatch", "#!/bin/bash\n")
    renamed = {os.path.relpath(p, tmp_path) for kind, p in disk.events if kind == "replace"}
    expected = {"run/rollouts/step=000001/_manifest.json", "run/weights/step=000001/_manifest.json"}
    expected |= {"run/checkpoints/step=000001/trainer/_manifest.json", "run/metrics.jsonl", "run/state.json"}
    expected |= {"run/lease.json", "job.sbatch"}
    assert expected <= renamed, expected - renamed
    assert disk.renames_not_made_durable() == []
    # the step folders the commits created are durable in their parents too
    synced = {os.path.relpath(p, tmp_path) for kind, p in disk.events if kind == "fsync-dir"}
    assert {"run/rollouts", "run/weights", "run/checkpoints", "run/checkpoints/step=000001"} <= synced


def test_a_stray_step_folder_is_skipped_with_a_warning_by_every_listing(tmp_path, caplog):
    out = tmp_path / "run"
    fs, root = get_fs(str(out))
    for s in (1, 2):
        rows = _rows(s)
        rollouts.write_step(fs, root, s, rollouts.to_table(rows), {"gen_s": 0.1, "dropped": 0, "versions": {0: 3}})
    weights.publish(fs, root, 2, {"w": torch.zeros(2)})
    checkpoints.save(fs, root, 2, "trainer", {"trainer_state.pt": b"x"})
    for parent in ("rollouts", "weights", "checkpoints"):
        stray = out / parent / "step=latest"
        stray.mkdir()
        (stray / "_manifest.json").write_text("{}")  # even one that looks committed
    with caplog.at_level(logging.WARNING, logger="rollflow.storage"):
        assert committed_steps(fs, f"{root}/rollouts") == [1, 2]
        assert sorted(step_dirs(fs, f"{root}/weights")) == [2]
        assert checkpoints.checkpoint_steps(fs, root) == [2]
        assert resume.resume_point(fs, root, print) == 2
        resume.rollback(fs, root, 2)
        report = lake.inspect(str(out))
    assert report["rollout_steps"] == [1, 2] and report["errors"] == []
    warned = [r.getMessage() for r in caplog.records if "step=latest" in r.getMessage()]
    assert {Path(m.split()[1].rstrip(":")).parent.name for m in warned} == {"rollouts", "weights", "checkpoints"}
    assert len(warned) == 3  # once per folder, however often it is listed
    assert all((out / p / "step=latest").is_dir() for p in ("rollouts", "weights", "checkpoints"))  # left alone
