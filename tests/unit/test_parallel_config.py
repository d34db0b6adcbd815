"""`trainer.parallel` validation: every refusal names the key and what would be valid (no torch)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config.run import RunConfig
from config.trainer_parallel import TrainerParallelConfig

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "qk_norm": True}


def _run(parallel: dict, **model) -> RunConfig:
    return RunConfig.model_validate({"trainer": {"parallel": parallel}, "model": model})


def _refused(parallel: dict, *needles: str, **model) -> None:
    with pytest.raises(ValidationError) as err:
        _run(parallel, **model)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_defaults_are_one_plain_process():
    p = RunConfig().trainer.parallel
    assert (p.world_size, p.shard_size, p.dp_size, p.distributed) == (1, 1, 1, False)


def test_dp_shard_fills_the_world_and_hsdp_multiplies():
    assert TrainerParallelConfig(world_size=4).shard_size == 4
    hsdp = TrainerParallelConfig(world_size=8, dp_replicate=2, tp=2)
    assert (hsdp.shard_size, hsdp.dp_size) == (2, 4)


def test_sizes_must_multiply_to_the_world_size():
    _refused({"world_size": 4, "dp_shard": 3}, "world_size=4", "dp_shard = 4")
    _refused({"world_size": 4, "tp": 3}, "does not divide world_size=4")
    _refused({"world_size": 2, "dp_shard": 0}, "trainer.parallel.dp_shard=0", "-1")


def test_tp_must_divide_heads_and_kv_heads():
    _refused({"world_size": 4, "tp": 4}, "trainer.parallel.tp=4", "model.num_kv_heads=2")
    _run({"world_size": 2, "tp": 2})  # 4 heads, 2 kv heads


def test_ep_needs_experts_it_divides_and_ranks_to_borrow():
    _refused({"world_size": 2, "ep": 2}, "trainer.parallel.ep=2", "dense", "set ep = 1")
    _refused({"world_size": 4, "ep": 4}, "model.num_experts=6", num_experts=6, num_experts_per_tok=2, qk_norm=True)
    _refused({"world_size": 2, "dp_replicate": 2, "ep": 2}, "dp_shard * cp * tp = 1")
    _run({"world_size": 2, "ep": 2}, **MOE)


def test_cp_needs_a_sequence_length_it_divides():
    _refused({"world_size": 2, "cp": 2}, "trainer.parallel.cp=2", "2 * cp * tp = 4", max_seq_len=66)
    _run({"world_size": 2, "cp": 2})  # max_seq_len 64


def test_tp_runs_on_dense_models_only():
    _refused({"world_size": 2, "tp": 2}, "trainer.parallel.tp=2 on a MoE model (model.num_experts=4)", **MOE)
    _refused({"world_size": 4, "tp": 2, "ep": 2}, "on a MoE model", **MOE)


def test_cp_runs_on_dense_models_without_tensor_parallelism():
    _refused({"world_size": 4, "cp": 2, "tp": 2}, "trainer.parallel cp=2", "got tp=2", "set cp = 1")
    _refused({"world_size": 2, "cp": 2}, "model.num_experts=4", **MOE)
    _run({"world_size": 4, "cp": 2})  # dp_shard 2 x cp 2


def test_hf_impl_gets_data_parallelism_only():
    for sizes in ({"tp": 2}, {"cp": 2}, {"ep": 2}):
        with pytest.raises(ValidationError, match='model.impl = "hf" supports only data parallelism'):
            RunConfig.model_validate(
                {"trainer": {"parallel": {"world_size": 2, **sizes}}, "model": {"path": "x", "impl": "hf"}}
            )
    RunConfig.model_validate({"trainer": {"parallel": {"world_size": 2}}, "model": {"path": "x", "impl": "hf"}})


def test_unknown_parallel_keys_are_refused():
    _refused({"world_size": 2, "fsdp": 2}, "fsdp")
