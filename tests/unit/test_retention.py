"""Retention keep-sets (pure functions) and applying them to a real run directory on disk."""

from __future__ import annotations

import torch

from config.storage import StorageConfig
from storage import checkpoints, retention, weights
from storage.fs import MANIFEST, committed_steps, get_fs, join
from storage.retention import checkpoints_to_keep, weights_to_keep


def test_default_keeps_everything():
    assert checkpoints_to_keep([2, 4, 6], None) == {2, 4, 6}
    assert weights_to_keep(list(range(10)), 4, None) == set(range(10))


def test_keep_last_and_every_checkpoints_always_keep_the_newest():
    assert checkpoints_to_keep([10, 20, 30, 40, 50], 2) == {40, 50}
    assert checkpoints_to_keep([10, 20, 30, 40, 50], 1, keep_every=20) == {20, 40, 50}
    assert checkpoints_to_keep([7], 1) == {7}
    assert checkpoints_to_keep([], 3) == set()


def test_weights_keep_version_zero_until_a_checkpoint_exists():
    assert weights_to_keep(list(range(8)), None, 2) == {0, 6, 7}


def test_weights_keep_the_checkpoint_version_and_everything_newer():
    # checkpoint at 4: a resume restarts from publication 4 and regenerates 5.. itself
    assert weights_to_keep(list(range(10)), 4, 2) == {4, 5, 6, 7, 8, 9}
    assert weights_to_keep(list(range(10)), 8, 1, keep_every=3) == {0, 3, 6, 8, 9}


def test_weights_keep_the_publication_of_every_kept_checkpoint():
    assert weights_to_keep(list(range(10)), 8, 1, kept_checkpoints=[4, 8]) == {4, 8, 9}


def test_weights_keep_the_delta_chain_of_kept_versions():
    # full publications at 0 and 5; every other version is a delta on the previous one
    bases = {v: (None if v in (0, 5) else v - 1) for v in range(10)}
    assert weights_to_keep(list(range(10)), 9, 1, base_of=bases.get) == {5, 6, 7, 8, 9}
    assert weights_to_keep(list(range(8)), None, 1, base_of=bases.get) == {0, 5, 6, 7}


def _publish(fs, root, versions):
    """As the trainer does: publish, then enforce retention."""
    for v in versions:
        weights.publish(fs, root, v, {"w": torch.full((4,), float(v))})
        retention.enforce(fs, root)


def _checkpoint(fs, root, step, component, files):
    checkpoints.save(fs, root, step, component, files)
    retention.enforce(fs, root)


def test_enforce_deletes_manifest_first_and_keeps_what_resume_needs(tmp_path, monkeypatch):
    s = StorageConfig(keep_last_weights=2, keep_last_checkpoints=1)
    fs, root = get_fs(str(tmp_path / "run"), s)
    _publish(fs, root, range(0, 6))
    assert committed_steps(fs, join(root, "weights")) == [0, 4, 5]  # 0: no checkpoint yet
    _checkpoint(fs, root, 3, "trainer", {"model.safetensors": b"x"})
    _checkpoint(fs, root, 3, "orchestrator", {"state.json": b"{}"})
    _publish(fs, root, [6])
    assert committed_steps(fs, join(root, "weights")) == [4, 5, 6]  # everything from checkpoint 3 on
    _checkpoint(fs, root, 6, "trainer", {"model.safetensors": b"y"})
    assert checkpoints.checkpoint_steps(fs, root) == [6]
    assert committed_steps(fs, join(root, "weights")) == [5, 6]  # last 2, and >= checkpoint 6
    assert not (tmp_path / "run" / "checkpoints" / "step=000003").exists()  # all components gone
    # a checkpoint being written (no manifest yet) is never touched
    (tmp_path / "run" / "checkpoints" / "step=000009" / "trainer").mkdir(parents=True)
    retention.enforce(fs, root, s)
    assert (tmp_path / "run" / "checkpoints" / "step=000009" / "trainer").exists()
    # rollouts are never part of a plan
    assert retention.plan(fs, root, s).weights == []


def test_apply_removes_the_manifest_before_the_files(tmp_path, monkeypatch):
    fs, root = get_fs(str(tmp_path / "run"))
    _publish(fs, root, range(3))
    order: list[str] = []
    real_rm = fs.rm

    def spy(path, *a, **k):
        order.append(path.rsplit("/", 1)[-1])
        return real_rm(path, *a, **k)

    monkeypatch.setattr(fs, "rm", spy)
    retention.apply(fs, root, retention.Plan(weights=[1], checkpoints=[]))
    assert order == [MANIFEST, "step=000001"]
    assert committed_steps(fs, join(root, "weights")) == [0, 2]


def test_enforce_without_limits_does_not_even_list(tmp_path, monkeypatch):
    fs, root = get_fs(str(tmp_path / "run"))
    monkeypatch.setattr(fs, "find", lambda *a, **k: (_ for _ in ()).throw(AssertionError("listed")))
    assert retention.enforce(fs, root, StorageConfig()) == retention.Plan([], [])
