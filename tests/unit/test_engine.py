"""The embedded engine's weight-update rules, without HTTP."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from config.model import ModelConfig
from engines.inference.embedded.engine import Engine, Request
from engines.inference.embedded.generate import Completion, Decoder, Sampling
from engines.models.decoder import CausalLM, token_logprobs
from engines.models.tokenizer import CharTokenizer

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


def _alone(model: CausalLM, prompt: list[int], params: Sampling, eos: int):
    decoder = Decoder(model, eos, TOK.pad_id)
    ((_, c),) = decoder.add([prompt], [params])
    while decoder.live:
        decoder.sample(0)
        if decoder.live:
            decoder.forward()
    return c


def _peaked() -> CausalLM:
    model = _model(0, CFG.model_copy(update={"num_layers": 2}))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)  # peaked outputs, so some rows end early at eos
    return model


ARRIVALS = {  # step -> (prompt text, n, sampling)
    0: ("rev:abc=", 3, Sampling(max_tokens=12, temperature=1.0)),
    2: ("sort:qwertyuiop=", 2, Sampling(max_tokens=9, temperature=0.7, top_k=5)),
    4: ("x=", 4, Sampling(max_tokens=14, temperature=1.3, top_p=0.9, min_tokens=3)),
    5: ("rev:ab=", 1, Sampling(max_tokens=6, temperature=1.0, ignore_eos=True)),
}


def _joined_batch(model, eos: int, arrivals=ARRIVALS) -> list[tuple[list[int], Sampling, Completion]] | None:
    """Rows arriving at the steps of ARRIVALS into one running batch; None if it ran dry before the last."""
    decoder = Decoder(model, eos, TOK.pad_id)
    joined: list[tuple[list[int], Sampling, Completion]] = []
    step = 0
    while step <= max(arrivals) or decoder.live:
        if step in arrivals:
            text, n, params = arrivals[step]
            rows = [dataclasses.replace(params, seed=1000 * step + k) for k in range(n)]
            made = decoder.add([TOK.encode(text)] * n, rows)
            joined += [(TOK.encode(text), p, c) for p, (_, c) in zip(rows, made, strict=True)]
        if not decoder.live:
            return None
        decoder.sample(0)
        if decoder.live:
            decoder.forward()
        step += 1
    return joined


def test_rows_that_join_a_running_batch_draw_what_they_draw_alone():
    """Requests join at later steps with longer and shorter prompts (the cache is realigned), finish early
    (compaction drops them and the slots no row uses), and each row equals the same row sampled alone."""
    model = _peaked()
    drawn = torch.tensor([t for *_, c in _joined_batch(model, -1) or [] for t in c.token_ids]).bincount()
    for eos in drawn.argsort(descending=True).tolist():  # one that ends some rows early, not all of them
        joined = _joined_batch(model, eos)
        reasons = {c.finish_reason for *_, c in joined or []}
        if reasons == {"stop", "length"}:
            break
    else:
        raise AssertionError("no end token gives both early and full-length rows")
    assert joined is not None
    for prompt, params, c in joined:
        alone = _alone(model, prompt, params, eos)
        assert c.token_ids == alone.token_ids and c.finish_reason == alone.finish_reason
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
        assert len(c.token_ids) >= params.min_tokens
        if params.ignore_eos:
            assert len(c.token_ids) == params.max_tokens


def test_a_request_joins_the_running_batch_between_steps(engine):
    """The second request is submitted while the first decodes; it joins that batch (one batch, two joins)
    and draws the same tokens as when it runs alone."""
    second = Request(TOK.encode("sort:zyx="), n=2, max_tokens=5, temperature=1.0, seed=7)
    first = Request(TOK.encode("rev:abcdef="), n=2, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    steps = 0

    def submit_second_mid_batch(events) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            engine.submit(second)

    first.on_tokens = submit_second_mid_batch
    engine.submit(first)
    joined = second.future.result(timeout=30)
    assert len(first.future.result(timeout=30)[0].token_ids) == 40
    assert engine.stats["batches"] == 1 and engine.stats["joins"] == 2
    alone = engine.submit(Request(TOK.encode("sort:zyx="), n=2, max_tokens=5, temperature=1.0, seed=7)).result(30)
    assert [c.token_ids for c in joined] == [c.token_ids for c in alone]


def test_hf_models_cache_joins_too():
    """`model.impl = "hf"`: transformers' DynamicCache is realigned and extended like rollflow's own cache."""
    import transformers

    from engines.models.hf import HFCausalLM

    cfg = CFG.model_copy(update={"num_layers": 2})
    hf_cfg = transformers.LlamaConfig(
        vocab_size=TOK.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HFCausalLM(transformers.LlamaForCausalLM(hf_cfg).eval(), cfg)
    arrivals = {  # a longer prompt joins (the running cache is padded), then a shorter one
        0: ("rev:abc=", 2, Sampling(max_tokens=6)),
        2: ("sort:qwertyuiop=", 1, Sampling(max_tokens=5)),
        3: ("x=", 1, Sampling(max_tokens=3)),
    }
    joined = _joined_batch(model, -1, arrivals)
    assert joined is not None
    for prompt, params, c in joined:
        alone = _alone(model, prompt, params, -1)
        assert c.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)


def test_an_update_mid_request_is_applied_between_steps_and_recorded(engine):
    """Weights published while a request decodes serve its next step; the request records both versions.
    Its first tokens are the old policy's (a full forward of the old weights scores them exactly), its last
    ones are not (they come from the new weights, over a KV cache the old ones wrote, as PipelineRL keeps it)."""
    import threading

    old, new = _model(0), _model(5)
    updated = threading.Event()
    steps = 0

    def update_after_three_steps(events) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            apply = lambda: (engine.update_weights(new.publishable_state_dict(), 9), updated.set())  # noqa: E731
            threading.Thread(target=apply).start()

    prompt = TOK.encode("rev:abc=")
    request = Request(prompt, n=1, max_tokens=30, temperature=1.0, seed=2, ignore_eos=True)
    request.on_tokens = update_after_three_steps
    (c,) = engine.submit(request).result(timeout=30)
    assert updated.wait(30) and c.policy_version == 0 and c.policy_version_end == 9
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        old_lp = token_logprobs(old(ids)[:, :-1], ids[:, 1:], 1.0)[0, len(prompt) - 1 :]
    served = torch.tensor(c.logprobs)
    assert torch.allclose(served[:3], old_lp[:3], atol=1e-5)
    assert not torch.allclose(served[-5:], old_lp[-5:], atol=1e-3)


def test_an_aborted_request_leaves_the_batch_and_the_others_draw_what_they_draw_alone(engine):
    """Abort (its client went away) after its first token: its rows end with finish reason "abort" and the
    tokens drawn so far; the request beside it runs to its end with the tokens it draws alone."""
    prompt = TOK.encode("rev:abc=")
    reference = engine.submit(Request(prompt, n=2, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True))
    expected = [c.token_ids for c in reference.result(timeout=30)]
    doomed = Request(prompt, n=3, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    doomed.on_tokens = lambda events: engine.abort(doomed)  # called on the engine thread after each step
    kept = Request(prompt, n=2, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    futures = [engine.submit(doomed), engine.submit(kept)]
    cut, whole = (f.result(timeout=30) for f in futures)
    assert [c.finish_reason for c in cut] == ["abort"] * 3
    assert all(1 <= len(c.token_ids) < 40 for c in cut)
    assert [c.token_ids for c in whole] == expected and all(c.finish_reason == "length" for c in whole)
    assert engine.stats["aborted"] == 1


def test_a_queued_request_that_is_aborted_never_runs():
    e = Engine(_model(0), 0, TOK.eos_id, TOK.pad_id, max_batch_size=2, seed=0)
    try:
        running = Request(TOK.encode("rev:ab="), n=2, max_tokens=30, temperature=1.0, ignore_eos=True)
        waiting = Request(TOK.encode("rev:ab="), n=2, max_tokens=30, temperature=1.0, ignore_eos=True)
        submitted = threading.Event()
        # the batch is full, so `waiting` is still queued when `running`'s next tokens arrive
        running.on_tokens = lambda events: e.abort(waiting) if submitted.is_set() else None
        e.submit(running)
        e.submit(waiting)
        submitted.set()
        outs = waiting.future.result(timeout=30)
        assert [c.finish_reason for c in outs] == ["abort", "abort"] and all(not c.token_ids for c in outs)
        assert len(running.future.result(timeout=30)[0].token_ids) == 30
    finally:
        e.stop()


def _joining_mid_batch(engine: Engine, *late: Request) -> Request:
    """A long request; once it has drawn 3 tokens, `late` are submitted together (they join its batch)."""
    first = Request(TOK.encode("rev:abcdef="), n=2, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    steps = 0

    def submit_late(events) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            for r in late:
                engine.submit(r)

    first.on_tokens = submit_late
    engine.submit(first)
    return first


def test_a_request_that_cannot_join_fails_alone(engine):
    """A sampling value no tensor holds (top_k = 2**63) fails its own request when it joins a running batch; the
    running request and one that joins with it finish as they would alone."""
    bad = Request(TOK.encode("rev:ab="), n=1, max_tokens=5, temperature=1.0, seed=1, top_k=2**63)
    good = Request(TOK.encode("sort:zyx="), n=2, max_tokens=5, temperature=1.0, seed=7)
    first = _joining_mid_batch(engine, bad, good)
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        bad.future.result(timeout=30)
    assert len(first.future.result(timeout=30)[0].token_ids) == 40
    alone = engine.submit(Request(TOK.encode("sort:zyx="), n=2, max_tokens=5, temperature=1.0, seed=7)).result(30)
    assert [c.token_ids for c in good.future.result(timeout=30)] == [c.token_ids for c in alone]


def test_a_stop_check_that_raises_fails_only_its_request(engine):
    def broken():
        def check(ids: list[int]) -> bool:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that cannot decode")

        return check

    bad = Request(TOK.encode("rev:ab="), n=2, max_tokens=5, temperature=1.0, seed=1, stop=broken)
    first = _joining_mid_batch(engine, bad)
    with pytest.raises(UnicodeDecodeError):
        bad.future.result(timeout=30)
    assert [len(c.token_ids) for c in first.future.result(timeout=30)] == [40, 40]
