"""Trainer checkpoints: the DCP format round-trips in one process, and the format from before DCP (the
optimizer inside trainer_state.pt) still restores on one process and is refused, with a message, by ranks."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import save as st_save

from engines.trainer import checkpoint
from engines.trainer.distributed import Dist
from storage import checkpoints
from storage.fs import get_fs


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 2)

    def publishable_state_dict(self):
        return self.state_dict()

    def load_published(self, sd):
        self.load_state_dict(sd)


def _stepped(seed: int) -> tuple[Tiny, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.w(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(model, {"optimizer": opt, "rng": checkpoint.RNGState()}, None, 0)


def test_the_dcp_format_round_trips(tmp_path):
    fs, root = get_fs(str(tmp_path))
    model, opt = _stepped(0)
    checkpoint.save(fs, root, 1, _state(model, opt))
    files = checkpoints.manifest(fs, root, 1, "trainer")["files"]
    assert "optimizer/.metadata" in files and "optimizer" not in torch.load(
        io.BytesIO((tmp_path / "checkpoints/step=000001/trainer/trainer_state.pt").read_bytes()), weights_only=True
    )
    fresh, fresh_opt = _stepped(1)
    checkpoint.restore_weights(fs, root, 1, fresh)
    checkpoint.restore(fs, root, 1, _state(fresh, fresh_opt))
    assert torch.equal(fresh.w.weight, model.w.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _old_format(tmp_path, model, opt) -> None:
    fs, root = get_fs(str(tmp_path))
    buf = io.BytesIO()
    torch.save({"step": 2, "optimizer": opt.state_dict(), "rng": checkpoint.RNGState().state_dict()}, buf)
    files = {"model.safetensors": st_save(model.state_dict()), "trainer_state.pt": buf.getvalue(),
             "run_state.json": json.dumps({"step": 2}).encode()}  # fmt: skip
    checkpoints.save(fs, root, 2, "trainer", files)


def test_a_checkpoint_from_before_dcp_restores_on_one_process(tmp_path):
    model, opt = _stepped(0)
    _old_format(tmp_path, model, opt)
    fs, root = get_fs(str(tmp_path))
    fresh, fresh_opt = _stepped(1)
    checkpoint.restore_weights(fs, root, 2, fresh)
    checkpoint.restore(fs, root, 2, _state(fresh, fresh_opt))
    assert torch.equal(fresh.w.weight, model.w.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_ranks_refuse_a_checkpoint_from_before_dcp_with_the_way_out(tmp_path):
    model, opt = _stepped(0)
    _old_format(tmp_path, model, opt)
    fs, root = get_fs(str(tmp_path))
    with pytest.raises(SystemExit, match="world_size = 1"):
        checkpoint.restore(fs, root, 2, _state(*_stepped(1)), Dist(rank=0, world=2, dp_size=2))


def test_a_copied_capture_does_not_follow_the_training_loop(tmp_path):
    fs, root = get_fs(str(tmp_path))
    model, opt = _stepped(0)
    taken = checkpoint.capture(fs, root, 1, _state(model, opt), copy=True)
    live = checkpoint.capture(fs, root, 1, _state(model, opt))
    before = taken.weights["w.weight"].clone(), taken.optimizer["state"]["w.weight"]["exp_avg"].clone()
    model.w(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert torch.equal(taken.weights["w.weight"], before[0])
    assert torch.equal(taken.optimizer["state"]["w.weight"]["exp_avg"], before[1])
    assert not torch.equal(live.weights["w.weight"], before[0])  # without the copy it would have moved
