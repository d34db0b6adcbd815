"""The `rl` flow hands the collective transport's secret to the two processes that use it, fresh each attempt,
through their environment only."""

from __future__ import annotations

from config.run import RunConfig
from config.transport import TRANSPORT_SECRET_ENV


def test_each_attempt_draws_a_secret_for_the_engine_and_the_trainer_only():
    from flows.rl import _component_env

    cfg = RunConfig.model_validate({"weight_broadcast": {"type": "collective"}})
    first, second = _component_env(cfg, None), _component_env(cfg, None)
    assert first["inference"][TRANSPORT_SECRET_ENV] == first["trainer"][TRANSPORT_SECRET_ENV]
    assert len(first["trainer"][TRANSPORT_SECRET_ENV]) == 64
    assert first["trainer"][TRANSPORT_SECRET_ENV] != second["trainer"][TRANSPORT_SECRET_ENV]
    assert all(TRANSPORT_SECRET_ENV not in first[name] for name in ("orchestrator", "teacher", "warmup"))
    assert all(TRANSPORT_SECRET_ENV not in env for env in _component_env(RunConfig(), None).values())
