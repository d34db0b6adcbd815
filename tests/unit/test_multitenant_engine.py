"""The shared server's engine (docs/multitenant.md): rows of several tenants, each with its own LoRA adapter (rank
and targets), decoded in one batch through the multi-slot layer (engines/models/lora.py `MultiLoRALinear`), and
per-tenant versions and in-flight updates in the engine thread (engines/inference/embedded/engine.py).

References are today's single-adapter models (`LoRALinear`, lora.attach_to) holding the same adapter tensors.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from config.model import LoRAConfig, ModelConfig
from engines.inference.embedded.engine import Engine, Request, TenantGone
from engines.inference.embedded.generate import Decoder, Sampling
from engines.models import lora
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from engines.seeds import row_seeds

CFG = ModelConfig(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, max_seq_len=96)
TOK = CharTokenizer()
MAX_RANK = 8
# three tenants: different ranks, scalings and targets (slot 1..3); slot 0 rows get the backbone alone
TENANTS = {
    1: LoRAConfig(rank=4, alpha=8.0),
    2: LoRAConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]),
    3: LoRAConfig(rank=2, alpha=3.0, target_modules=["down_proj", "o_proj"]),
}
# measured max |shared - single| token logprob: 1.9e-6 (fp32, batch-size rounding); bound at that scale
EXACT = 1e-5


def _backbone() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(CFG, TOK.vocab_size).eval()


def _tenant(backbone: CausalLM, cfg: LoRAConfig, seed: int) -> CausalLM:
    """A single-adapter model (LoRALinear) on the backbone, with non-zero A and B."""
    model = copy.deepcopy(backbone)
    lora.attach_to(model, cfg)
    g = torch.Generator().manual_seed(seed)
    for m in lora.adapted_modules(model).values():
        m.lora_A.weight.data.normal_(0, 0.3, generator=g)
        m.lora_B.weight.data.normal_(0, 0.3, generator=g)
    return model.eval()


def _shared(backbone: CausalLM, singles: dict[int, CausalLM]) -> CausalLM:
    model = copy.deepcopy(backbone)
    lora.attach_slots(model, len(TENANTS) + 1, MAX_RANK)
    for slot, single in singles.items():
        adapters = lora.adapter_state_dict(single)
        lora.check_slot_adapter(model, adapters, MAX_RANK)
        lora.fill_slot(model, slot, adapters, TENANTS[slot].alpha / TENANTS[slot].rank)
    return model.eval()


def _decode(model: CausalLM, rows: list[tuple[list[int], Sampling]]):
    """Every row decoded to its end in one running batch; the completions in row order."""
    decoder = Decoder(model, TOK.eos_id, TOK.pad_id)
    made = decoder.add([p for p, _ in rows], [s for _, s in rows])
    while True:
        decoder.sample(0)
        if not decoder.live:
            return [c for _, c in made]
        decoder.forward()


def _rows(slot: int) -> list[tuple[list[int], Sampling]]:
    """Two prompts per tenant, two samples each; the same prompt for every tenant (prefilled once per tenant)."""
    prompts = [TOK.encode("rev:abcd="), TOK.encode(f"sort:{'zyx'[: slot + 1]}q=")]
    return [(p, Sampling(max_tokens=12, seed=100 * slot + 2 * i + j, slot=slot)) for i, p in enumerate(prompts)
            for j in range(2)]  # fmt: skip


@pytest.fixture(scope="module")
def models():
    backbone = _backbone()
    singles = {slot: _tenant(backbone, cfg, seed=slot) for slot, cfg in TENANTS.items()}
    return backbone, singles, _shared(backbone, singles)


def test_rows_of_three_tenants_in_one_batch_match_each_tenant_alone(models):
    backbone, singles, shared = models
    rows = [r for slot in (0, 1, 2, 3) for r in _rows(slot)]
    together = _decode(shared, rows)
    worst = 0.0
    for slot in (0, 1, 2, 3):
        ref = backbone if slot == 0 else singles[slot]
        alone = _decode(ref, [(p, Sampling(**{**s.__dict__, "slot": 0})) for p, s in _rows(slot)])
        mine = [c for c, (_, s) in zip(together, rows, strict=True) if s.slot == slot]
        for a, b in zip(alone, mine, strict=True):
            assert a.token_ids == b.token_ids and len(a.token_ids) > 0
            worst = max(worst, float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()))
    print(f"max |shared - single-adapter| token logprob: {worst:.3g}")
    assert worst < EXACT
    # the adapters matter: a tenant's rows differ from the backbone's on the same prompt and seed
    base = _decode(backbone, [(p, Sampling(**{**s.__dict__, "slot": 0})) for p, s in _rows(1)])
    assert any(a.logprobs != b.logprobs for a, b in zip(base, together[4:8], strict=True))


def test_an_adapter_that_does_not_fit_the_slots_is_refused(models):
    _, singles, shared = models
    adapters = lora.adapter_state_dict(singles[1])
    key = next(iter(adapters))
    with pytest.raises(ValueError, match="names no adaptable layer"):
        lora.check_slot_adapter(shared, {"nope.lora_A.weight": adapters[key]}, MAX_RANK)
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora.check_slot_adapter(shared, adapters, 2)
    half = {k: v for k, v in adapters.items() if ".lora_A." in k}
    with pytest.raises(ValueError, match="has no"):
        lora.check_slot_adapter(shared, half, MAX_RANK)


def _alone_switching(model: CausalLM, new: dict, prompt: list[int], seed: int, at: int):
    """The single-adapter reference of A's request: its rows decoded alone, the adapter replaced after `at` tokens
    (the cache of the tokens before stays, as in any in-flight update)."""
    model = copy.deepcopy(model)
    decoder = Decoder(model, TOK.eos_id, TOK.pad_id)
    made = decoder.add([prompt] * 3, [Sampling(max_tokens=16, seed=s, ignore_eos=True) for s in row_seeds(seed, 3)])
    for step in range(1, 17):
        decoder.sample(0 if step <= at else 1)
        if step == at:
            model.weights_module().load_state_dict(new, strict=False)
        if decoder.live:
            decoder.forward()
    return [c for _, c in made]


def _run(engine: Engine, update_at: int | None, new: dict | None) -> tuple[list, list]:
    """Tenant A (slot 1) and B (slot 2) requests queued together; with `update_at`, A's adapter becomes version 1
    while A's rows hold that many tokens (queued from the engine thread, applied before the next step)."""
    prompt = TOK.encode("rev:abcdef=")
    a = Request(prompt, n=3, max_tokens=16, temperature=1.0, seed=1, ignore_eos=True, slot=1, lease=1)
    b = Request(prompt, n=3, max_tokens=16, temperature=1.0, seed=2, ignore_eos=True, slot=2, lease=2)
    queued = threading.Event()

    def on_a(events) -> None:
        if update_at is not None and new is not None and not queued.is_set() and len(events) and events[0][0] == 0:
            a_tokens = on_a.count = getattr(on_a, "count", 0) + 1  # type: ignore[attr-defined]
            if a_tokens == update_at:
                engine.queue_slot_update(1, 1, new, TENANTS[1].alpha / TENANTS[1].rank, 1)
                queued.set()

    a.on_tokens = on_a
    engine.submit_many([a, b])
    return a.future.result(timeout=60), b.future.result(timeout=60)


def test_an_in_flight_update_of_one_tenant_touches_only_its_rows(models):
    backbone, singles, _ = models
    new_a = _tenant(backbone, TENANTS[1], seed=11)
    engine = Engine(_shared(backbone, singles), 0, TOK.eos_id, TOK.pad_id, max_batch_size=16, seed=0)
    try:
        for slot in (1, 2):
            engine.open_slot(slot, lease=slot)
            adapters, cfg = lora.adapter_state_dict(singles[slot]), TENANTS[slot]
            assert engine.update_slot(slot, slot, adapters, cfg.alpha / cfg.rank, 0) == 0
        a0, b0 = _run(engine, None, None)
        a1, b1 = _run(engine, 5, lora.adapter_state_dict(new_a))
        assert engine.slot_versions == {1: 1, 2: 0}
    finally:
        engine.stop()
    ref = _alone_switching(singles[1], lora.adapter_state_dict(new_a), TOK.encode("rev:abcdef="), 1, at=5)
    for c, r in zip(a1, ref, strict=True):  # A's rows: 5 tokens from version 0, the rest from version 1
        assert (c.policy_version, c.policy_version_end) == (r.policy_version, r.policy_version_end) == (0, 1)
        assert c.token_ids == r.token_ids
        assert float((torch.tensor(c.logprobs) - torch.tensor(r.logprobs)).abs().max()) < EXACT
    assert [c.logprobs[5:] for c in a0] != [c.logprobs[5:] for c in a1]
    assert [c.logprobs[:5] for c in a0] == [c.logprobs[:5] for c in a1]
    for before, after in zip(b0, b1, strict=True):  # B's rows: bit for bit what they were without the update
        assert (after.policy_version, after.policy_version_end) == (0, 0)
        assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_closing_a_slot_fails_its_requests_only_and_clears_it(models):
    backbone, singles, _ = models
    engine = Engine(_shared(backbone, singles), 0, TOK.eos_id, TOK.pad_id, max_batch_size=16, seed=0)
    try:
        for slot in (1, 2):
            engine.open_slot(slot, lease=slot)
            cfg = TENANTS[slot]
            engine.update_slot(slot, slot, lora.adapter_state_dict(singles[slot]), cfg.alpha / cfg.rank, 3)
        prompt = TOK.encode("rev:abc=")
        started = threading.Event()
        a = Request(prompt, n=2, max_tokens=60, temperature=1.0, seed=1, ignore_eos=True, slot=1, lease=1)
        a.on_tokens = lambda events: started.set()
        b = Request(prompt, n=2, max_tokens=60, temperature=1.0, seed=2, ignore_eos=True, slot=2, lease=2)
        engine.submit_many([a, b])
        assert started.wait(30)
        engine.close_slot(1, TenantGone("tenant a left"), timeout=30)
        with pytest.raises(TenantGone, match="tenant a left"):
            a.future.result(timeout=30)
        assert all(len(c.token_ids) == 60 for c in b.future.result(timeout=60))
        assert engine.slot_versions == {2: 3}
        assert not any(1 in m.ranks for m in lora.slot_layers(engine.model).values())
        late = Request(prompt, n=1, max_tokens=2, temperature=1.0, slot=1, lease=1)  # the old lease is gone
        with pytest.raises(TenantGone):
            engine.submit(late).result(timeout=5)
        with pytest.raises(TenantGone):
            engine.update_slot(1, 1, {}, 1.0, 4)
        engine.open_slot(1, lease=7)  # free again, for another tenant
        assert engine.slot_versions[1] == -1
    finally:
        engine.stop()


def test_only_backends_that_serve_tenants_take_a_shared_deployment():
    from engines.inference import backend as backends
    from engines.registry import PluginError

    backends.check_shared("embedded")
    with pytest.raises(PluginError, match="load_lora_adapter.*registered backends that do: embedded"):
        backends.check_shared("vllm")
