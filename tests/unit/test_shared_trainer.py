"""The shared trainer in process (engines/trainer/shared.py) on real deployment and tenant directories
(tests/shared_trainer_fixture.py): the same adapters as a standalone RLTrainer on the same rollouts with the
backbone's tensors shared, a failing tenant isolated, records followed (join, leave, higher attempt, refusals),
weighted round robin and the shares it reports."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import fsspec
import pytest
from safetensors.torch import load_file

from config.model import LoRAConfig
from config.process import SharedTrainerProcessConfig, TrainerProcessConfig
from engines.models import lora
from engines.trainer.rl import RLTrainer
from engines.trainer.shared import RoundRobin, SharedTrainer
from storage.fs import read_json, write_json
from storage.lora import ADAPTER_FILE
from storage.tenants import read_status, remove_tenant, write_tenant
from tests.shared_trainer_fixture import commit_rollouts, deployment, tenant, tenant_record, trainer_config

LORA_A = LoRAConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "v_proj"])  # dropout: RNG per step
LORA_B = LoRAConfig(rank=8, alpha=16.0)
FS = fsspec.filesystem("file")
BOUND_S = 60  # every in-process loop below ends within this (they take about a second)


def _shared(d) -> SharedTrainer:
    return SharedTrainer(
        SharedTrainerProcessConfig.model_validate(read_json(str(d / "config" / "shared_trainer.json")))
    )


def _run_until(st: SharedTrainer, done) -> None:
    deadline = time.monotonic() + BOUND_S
    st.run(until=lambda: done() or time.monotonic() > deadline)
    assert done(), {n: t.status for n, t in st.tenants.items()}


def _states(*dirs) -> list[str | None]:
    return [getattr(read_status(str(t)), "state", None) for t in dirs]


def _write(path: str, obj) -> None:
    write_json(FS, path, obj)


def _standalone_copy(t: Path) -> Path:
    """The tenant's run directory as it is now, beside it, for a standalone trainer."""
    s = t.parent / f"solo-{t.name}"
    shutil.copytree(t, s)
    cfg = read_json(str(s / "config" / "trainer.json"))
    cfg["run"]["output_dir"] = str(s)
    _write(str(s / "config" / "trainer.json"), cfg)
    return s


def _max_diff(t: Path, s: Path, step: int) -> float:
    """Max |adapter of t - adapter of s| over publication `step`'s tensors (the same names in both)."""
    mine, theirs = _adapter(t, step), _adapter(s, step)
    assert mine.keys() == theirs.keys()
    return max(float((mine[k] - theirs[k]).abs().max()) for k in mine)


def _adapter(t, step: int) -> dict:
    return load_file(str(t / "weights" / f"step={step:06d}" / ADAPTER_FILE))


def test_tenants_train_the_standalone_adapters_on_a_shared_backbone(tmp_path):
    d, ta, tb = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta"
    deployment(d)
    tenant(d, ta, LORA_A, seed=1, steps=3, max_steps=3)
    tenant(d, tb, LORA_B, seed=2, steps=3, max_steps=3, weight=2.0)
    standalone = {t: _standalone_copy(t) for t in (ta, tb)}

    st = _shared(d)
    st.refresh()
    a, b = (st.tenants[n].trainer for n in ("alpha", "beta"))
    assert a is not None and b is not None
    base = dict(st.backbone.named_parameters())
    b_params = dict(b.model.named_parameters())
    b_ptrs = {p.data_ptr() for p in b_params.values()} | {p.data_ptr() for p in base.values()}
    for name, p in a.model.named_parameters():
        if ".lora_" in name:  # adapters are each tenant's own
            assert p.requires_grad and p.data_ptr() not in b_ptrs, name
        else:  # the backbone's very tensors, frozen
            assert p.data_ptr() == base[name].data_ptr() == b_params[name].data_ptr(), name
            assert not p.requires_grad
    assert set(lora.adapter_state_dict(a.model)) != set(lora.adapter_state_dict(b.model))  # targets differ
    _run_until(st, lambda: _states(ta, tb) == ["finished", "finished"])

    for t, s in standalone.items():
        RLTrainer(trainer_config_from(s)).run()
        diff = _max_diff(t, s, 3)
        first, last = _adapter(s, 1), _adapter(s, 3)
        moved = max(float((last[k] - first[k]).abs().max()) for k in first)  # what the steps changed
        print(f"{t.name}: max |shared - standalone| over the adapters after 3 steps = {diff:.3g} (moved {moved:.3g})")
        assert moved > 1e-4 and diff <= 1e-6  # measured 0 here: same ops, same RNG draws, one thread
    status = read_status(str(tb))
    assert status is not None and status.step == 3 and status.trainer_s > 0 and status.error is None


def trainer_config_from(s) -> TrainerProcessConfig:
    return TrainerProcessConfig.model_validate(read_json(str(s / "config" / "trainer.json")))


def test_a_failing_tenant_is_marked_failed_while_another_keeps_stepping(tmp_path):
    d, ta, tb = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta"
    deployment(d)
    tenant(d, ta, LORA_B, seed=1, steps=4, max_steps=4)
    tenant(d, tb, LORA_B, seed=2, steps=4, max_steps=4)
    shard = tb / "rollouts" / "step=000002" / "part-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    st = _shared(d)
    _run_until(st, lambda: _states(ta, tb) == ["finished", "failed"])
    failed = read_status(str(tb))
    assert failed is not None and failed.step == 1 and "step=000002" in (failed.error or "")
    assert [json.loads(x)["step"] for x in (ta / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (ta / "checkpoints" / "step=000004").exists()
    st.refresh()  # the failed attempt is not retried while its record stays
    assert st.tenants["beta"].status.state == "failed" and st.tenants["beta"].trainer is None


def test_records_join_leave_and_a_higher_attempt_resumes_from_its_checkpoint(tmp_path):
    d, ta, tb = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta"
    deployment(d, max_tenants=2)
    tenant(d, ta, LORA_B, seed=1, steps=2, max_steps=4)
    solo = _standalone_copy(ta)
    st = _shared(d)
    _run_until(st, lambda: getattr(read_status(str(ta)), "step", 0) == 2)
    assert st.tenants["alpha"].status.state == "waiting"

    tenant(d, tb, LORA_B, seed=2, steps=1, max_steps=1)  # joins while alpha waits; finishes alone
    _run_until(st, lambda: _states(tb) == ["finished"])
    remove_tenant(str(d), "beta")
    st.refresh()
    assert set(st.tenants) == {"alpha"}  # left

    # alpha's next attempt resumes from its checkpoint at step 2 (checkpoint.interval = 2)
    cfg = trainer_config(ta, LORA_B, seed=1, max_steps=4, resume_step=2)
    _write(str(ta / "config" / "trainer.json"), cfg.model_dump(mode="json"))
    write_tenant(str(d), tenant_record(ta, attempt=1, resume_step=2))
    st.refresh()
    held = st.tenants["alpha"]
    assert held.record.attempt == 1 and held.trainer is not None and held.trainer.next_step == 3
    status = read_status(str(ta))
    assert status is not None and (status.attempt, status.state, status.step) == (1, "waiting", 2)
    write_tenant(str(d), tenant_record(ta, attempt=0))  # an older attempt is ignored
    st.refresh()
    assert st.tenants["alpha"].record.attempt == 1 and st.tenants["alpha"].trainer is held.trainer

    # the resumed attempt ends where an uninterrupted standalone trainer on the same rollouts does
    for step in (3, 4):
        commit_rollouts(ta, step, seed=1)
        commit_rollouts(solo, step, seed=1)
    _run_until(st, lambda: _states(ta) == ["finished"])
    RLTrainer(trainer_config_from(solo)).run()
    diff = _max_diff(ta, solo, 4)
    print(f"resumed shared vs uninterrupted standalone, adapters after 4 steps: max diff {diff:.3g}")
    assert diff <= 1e-6


def test_refusals_are_the_tenants_own(tmp_path):
    d, ta, tb, tc = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta", tmp_path / "gamma"
    deployment(d, max_tenants=2)
    tenant(d, ta, LoRAConfig(rank=32), seed=1, steps=0, max_steps=2)  # above max_lora_rank=16
    tenant(d, tb, LORA_B, seed=2, steps=1, max_steps=1)
    cfg = read_json(str(tb / "config" / "trainer.json"))
    tenant(d, tc, LORA_B, seed=3, steps=0, max_steps=2)
    cfg_c = read_json(str(tc / "config" / "trainer.json"))
    cfg_c["model"]["hidden_size"] = 64  # not the backbone
    _write(str(tc / "config" / "trainer.json"), cfg_c)
    assert cfg["model"]["lora"]["rank"] == 8
    st = _shared(d)
    _run_until(st, lambda: _states(ta, tb, tc) == ["failed", "finished", "failed"])
    assert "max_lora_rank=16" in (read_status(str(ta)).error or "")  # type: ignore[union-attr]
    assert "hidden_size" in (read_status(str(tc)).error or "")  # type: ignore[union-attr]


def test_weighted_round_robin_over_ready_tenants():
    rr = RoundRobin()
    order = [rr.pick({"a": 1.0, "b": 2.0, "c": 1.0}) for _ in range(8)]
    assert order.count("b") == 4 and order.count("a") == order.count("c") == 2
    assert order[:4] == ["b", "a", "c", "b"]  # smooth: b's turns spread out, ties to the first name
    assert rr.pick({}) is None
    picks = [rr.pick({"a": 1.0}) for _ in range(3)] + [rr.pick({"a": 1.0, "c": 1.0}) for _ in range(4)]
    assert picks[:3] == ["a"] * 3 and sorted(picks[3:]) == ["a", "a", "c", "c"]  # only the ready earn


def test_the_shares_follow_the_weights(tmp_path):
    d, ta, tb = tmp_path / "deploy", tmp_path / "alpha", tmp_path / "beta"
    deployment(d)
    tenant(d, ta, LORA_B, seed=1, steps=6, max_steps=6, weight=2.0)
    tenant(d, tb, LORA_B, seed=2, steps=6, max_steps=6)
    st = _shared(d)
    st.refresh()
    picked = [st.step_one() for _ in range(6)]
    assert picked.count("alpha") == 4 and picked.count("beta") == 2, picked
    st.write_summary()
    summary = read_json(str(d / "shared_trainer.json"))["tenants"]
    shares = {n: summary[n]["share"] for n in ("alpha", "beta")}
    print(f"shares of trainer time after 4 + 2 steps of equal size: {shares}")
    assert [summary[n]["steps"] for n in ("alpha", "beta")] == [4, 2]
    spent = {n: summary[n]["trainer_s"] for n in ("alpha", "beta")}
    assert min(spent.values()) > 0 and shares["alpha"] == pytest.approx(spent["alpha"] / sum(spent.values()))
    assert shares["alpha"] + shares["beta"] == pytest.approx(1.0)  # time-based: no tighter bound on shared cores
