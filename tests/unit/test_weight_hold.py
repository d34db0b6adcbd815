"""The weight follower's hold (engines/orchestrator/loop.py WeightSync.target): during an online evaluation of
version V the engine is never sent a newer publication, so every sample of that evaluation comes from V."""

from __future__ import annotations

import torch

from engines.orchestrator.loop import WeightSync
from storage import weights
from storage.fs import Storage


def _sync(tmp_path, versions: list[int]) -> WeightSync:
    fs, root = Storage(None).open(str(tmp_path / "run"))
    for v in versions:
        weights.publish(fs, root, v, {"w": torch.full((2,), float(v))})
    return WeightSync(None, fs, root, "", 1.0)


def test_without_a_hold_the_newest_publication_is_the_target(tmp_path):
    assert _sync(tmp_path, [0, 1, 2]).target() == 2
    assert _sync(tmp_path / "empty", []).target() is None


def test_a_hold_caps_the_target_at_the_held_version(tmp_path):
    sync = _sync(tmp_path, [0, 1, 2, 3])
    sync.hold = 1
    assert sync.target() == 1
    sync.hold = 5  # not published yet: the newest below it
    assert sync.target() == 3
    sync.hold = None
    assert sync.target() == 3


def test_a_hold_on_a_version_whose_publication_is_gone_is_ignored(tmp_path):
    """A rollback removed the held version while newer ones exist: waiting for it would never end."""
    sync = _sync(tmp_path, [0, 2, 3])
    sync.hold = 1
    assert sync.target() == 3


def test_the_follower_reads_only_whether_the_next_version_is_committed(tmp_path):
    """Between listings the follower asks storage one question per poll: is the engine's next version there
    (and not held back)?"""
    sync = _sync(tmp_path, [0])
    assert sync.next_published()  # the engine serves nothing yet (-1): version 0 is next
    sync.engine_version = 0
    assert not sync.next_published()
    weights.publish(sync.fs, sync.root, 2, {"w": torch.zeros(2)})
    assert not sync.next_published()  # 2 is not next: the listing finds it
    weights.publish(sync.fs, sync.root, 1, {"w": torch.ones(2)})
    assert sync.next_published()
    sync.hold = 0
    assert not sync.next_published()  # held at 0: version 1 may not be pushed
