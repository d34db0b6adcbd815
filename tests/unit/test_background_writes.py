"""The trainer's background writes (engines/trainer/background.py): in submission order, a failure raised on the
submitting thread, a bounded wait; and a checkpoint written there holds the state at its step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engines.trainer import checkpoint
from engines.trainer.background import Writes
from storage import checkpoints
from storage.fs import get_fs
from tests.unit.test_checkpoint_formats import _state, _stepped


def test_writes_run_in_the_order_they_came_and_wait_drains_them():
    done: list[int] = []
    writes = Writes(timeout_s=30, depth=2)
    for i in range(6):
        writes.submit(f"write {i}", lambda i=i: (time.sleep(0.01 * (i % 2)), done.append(i)))
        assert len(writes._pending) <= 2  # a loop that outruns storage waits in submit
    writes.wait()
    assert done == list(range(6))


def test_a_failed_write_raises_on_the_next_submit_once():
    writes = Writes(timeout_s=30)
    writes.submit("publication 3", lambda: 1 / 0)
    time.sleep(0.05)
    with pytest.raises(ZeroDivisionError):
        writes.submit("publication 4", lambda: None)
    writes.wait()  # reported once; the later write ran


def test_a_write_that_does_not_finish_in_time_is_an_error_naming_it():
    release = threading.Event()
    writes = Writes(timeout_s=0.2)
    writes.submit("checkpoint step=5", lambda: release.wait(10))
    with pytest.raises(TimeoutError, match="checkpoint step=5: still being written after 0s"):
        writes.wait()
    release.set()


def test_a_checkpoint_written_in_the_background_holds_the_state_at_its_step(tmp_path):
    fs, root = get_fs(str(tmp_path))
    model, opt = _stepped(0)
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    writes = Writes(timeout_s=60)
    captured = checkpoint.capture(fs, root, 1, _state(model, opt), copy=True)
    writes.submit("checkpoint step=1", lambda: checkpoint.write(fs, root, captured))
    for _ in range(3):  # the loop trains on while the thread writes
        model.w(torch.ones(1, 3)).sum().backward()
        opt.step()
    writes.wait()
    fresh, fresh_opt = _stepped(1)
    checkpoint.restore_weights(fs, root, 1, fresh)
    checkpoint.restore(fs, root, 1, _state(fresh, fresh_opt))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_step.items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], moments)
    assert checkpoints.checkpoint_steps(fs, root) == [1]
