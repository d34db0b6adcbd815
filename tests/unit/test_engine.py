"""The embedded engine's weight-update rules, without HTTP."""

from __future__ import annotations

import pytest
import torch

from config.model import ModelConfig
from engines.inference.engine import Engine, Request
from engines.model import CausalLM
from engines.tokenizer import CharTokenizer

CFG = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TOK = CharTokenizer()


def _model(seed: int, cfg: ModelConfig = CFG) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(cfg, TOK.vocab_size)


@pytest.fixture
def engine():
    e = Engine(_model(0), 0, TOK.eos_id, TOK.pad_id, max_batch_size=64, seed=0)
    yield e
    e.stop()


def test_weights_that_do_not_fit_leave_the_model_untouched(engine):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    wrong = _model(1, CFG.model_copy(update={"hidden_size": 16, "intermediate_size": 32})).publishable_state_dict()
    with pytest.raises(ValueError, match="do not fit"):
        engine.update_weights(wrong, 1)
    assert engine.version == 0
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())


def test_versions_only_move_forward(engine):
    new = _model(2).publishable_state_dict()
    assert engine.update_weights(new, 3) == 3
    assert torch.equal(engine.model.model.embed_tokens.weight, new["model.embed_tokens.weight"])
    assert engine.update_weights(_model(3).publishable_state_dict(), 2) == 3  # older: a no-op
    assert torch.equal(engine.model.model.embed_tokens.weight, new["model.embed_tokens.weight"])


def test_requests_report_the_serving_version(engine):
    engine.update_weights(_model(4).publishable_state_dict(), 5)
    outs = engine.submit(Request(TOK.encode("rev:ab="), n=3, max_tokens=4, temperature=1.0)).result(timeout=30)
    assert len(outs) == 3 and all(c.policy_version == c.policy_version_end == 5 for c in outs)
