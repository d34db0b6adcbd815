"""What the trainer's mesh could express but `parallelize` does not run: refused at start, naming the sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from config.model import ModelConfig
from config.trainer_parallel import TrainerParallelConfig
from engines.trainer.parallel import _refuse_unsupported

DENSE = SimpleNamespace(cfg=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
MOE = SimpleNamespace(cfg=ModelConfig(num_experts=4, num_experts_per_tok=2, qk_norm=True))


def test_tensor_and_context_parallelism_alone_or_with_fsdp_on_a_dense_model_run():
    _refuse_unsupported(TrainerParallelConfig(world_size=2, tp=2), DENSE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=4, tp=2), DENSE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=4, tp=2, dp_replicate=2), DENSE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=4), DENSE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=2, cp=2), DENSE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=4, cp=2), DENSE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "model"),
    [
        ({"world_size": 4, "cp": 2, "tp": 2}, DENSE),
        ({"world_size": 2, "cp": 2}, MOE),
        ({"world_size": 4, "cp": 2, "ep": 2}, MOE),  # EP with CP
    ],
)
def test_context_parallelism_with_tp_or_moe_is_refused(sizes, model):
    with pytest.raises(SystemExit, match=r"trainer.parallel cp=2 runs with data parallelism .* got tp=\d"):
        _refuse_unsupported(TrainerParallelConfig(**sizes), model)


def test_expert_parallelism_with_data_parallelism_runs():
    _refuse_unsupported(TrainerParallelConfig(world_size=2, ep=2), MOE)  # type: ignore[arg-type]
    _refuse_unsupported(TrainerParallelConfig(world_size=4, ep=2), MOE)  # type: ignore[arg-type]  # efsdp = 2
    _refuse_unsupported(TrainerParallelConfig(world_size=4, ep=2, dp_replicate=2), MOE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "model"),
    [
        ({"world_size": 2, "tp": 2}, MOE),
        ({"world_size": 4, "tp": 2}, MOE),
        ({"world_size": 4, "tp": 2, "ep": 2}, MOE),  # EP with TP
    ],
)
def test_tensor_parallelism_on_moe_layers_is_refused_naming_tp_and_the_experts(sizes, model):
    with pytest.raises(SystemExit, match=r"trainer.parallel.tp=2 on a MoE model \(model.num_experts=4\)"):
        _refuse_unsupported(TrainerParallelConfig(**sizes), model)
