"""The built-in policy losses (engines/trainer/losses/builtin.py) against the published formulas, re-implemented
here token by token in float64, through `Objective` with each aggregation; their edge cases; the entropy and
reference-KL terms; the config's refusals."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from config.loss import BUILTIN_LOSSES, SEQUENCE_LEVEL
from config.trainer import TrainerConfig
from engines.trainer.losses.base import LossInputs
from engines.trainer.losses.objective import Objective, StepCounts, TokenScores, step_metrics
from engines.trainer.losses.registry import resolve

F64 = torch.float64
# rows: a 3-token, a 5-token, a 2-token and a one-token completion; row 4 has none (all masked)
MASK = torch.tensor(
    [
        [0, 0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0],
    ],
    dtype=F64,
)
ADV = torch.tensor([1.5, -0.7, 0.3, -1.1, 0.9], dtype=F64)
VOCAB = 5

# (id, loss config, reference formula's parameters); each case exercises its clip or mask on this data
CASES: list[tuple[str, dict[str, Any]]] = [
    ("masked_is", {"type": "masked_is", "mask_low": 0.7, "mask_high": 1.4}),
    ("ppo_clip", {"type": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28}),
    ("ppo_clip-proximal", {"type": "ppo_clip", "clip_low": 0.1, "clip_high": 0.15, "old_policy": "proximal"}),
    ("tis", {"type": "tis", "cap": 1.3}),
    ("mis", {"type": "mis", "mask_low": 0.8, "mask_high": 1.25}),
    ("icepop", {"type": "icepop", "mask_low": 0.7, "mask_high": 1.4}),
    ("icepop-proximal", {"type": "icepop", "mask_low": 0.7, "mask_high": 1.4, "old_policy": "proximal"}),
    ("cispo", {"type": "cispo", "ratio_min": 0.8, "ratio_max": 1.3}),
    ("cispo-proximal", {"type": "cispo", "ratio_max": 1.2, "old_policy": "proximal", "behaviour_cap": 1.3}),
    ("gspo", {"type": "gspo", "clip_low": 0.05, "clip_high": 0.08}),
    ("gspo-proximal", {"type": "gspo", "clip_low": 0.05, "clip_high": 0.08, "old_policy": "proximal"}),
    ("ipo", {"type": "ipo", "threshold": 0.08, "adv_tau": 0.7, "kl_tau": 0.05}),
]
IDS = [c[0] for c in CASES]
AGGREGATIONS: list[dict[str, Any]] = [
    {"aggregation": "token_mean"},
    {"aggregation": "sequence_mean"},
    {"aggregation": "constant", "constant_tokens": 8},
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors of a few dozen elements: intra-op threads only contend (on a busy host, 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- the published formulas, token by token


def _ppo(r: float, a: float, lo: float, hi: float) -> tuple[float, float]:
    """(min(r A, clip(r) A), its derivative in r)."""
    unclipped, clipped = r * a, min(max(r, lo), hi) * a
    return (unclipped, a) if unclipped <= clipped else (clipped, 0.0)


def reference_terms(cfg: dict[str, Any], lp, m, p, adv, mask) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token term and d term / d l, from the papers' formulas (docs/algorithm.md) with Python floats."""
    kind, c = cfg["type"], BUILTIN_LOSSES[cfg["type"]](**cfg)
    rows, cols = len(lp), len(lp[0])
    value = [[0.0] * cols for _ in range(rows)]
    grad = [[0.0] * cols for _ in range(rows)]
    proximal = getattr(c, "old_policy", "sampler") == "proximal"
    for i in range(rows):
        tokens = [t for t in range(cols) if mask[i][t]]
        old = p[i] if proximal else m[i]
        seq_mean = {
            "mis": sum(lp[i][t] - m[i][t] for t in tokens) / max(len(tokens), 1),
            "gspo": sum(lp[i][t] - old[t] for t in tokens) / max(len(tokens), 1),
        }.get(kind, 0.0)
        for t in tokens:
            a, lt, mt = adv[i], lp[i][t], m[i][t]
            w = min(math.exp(p[i][t] - mt), c.behaviour_cap) if proximal and hasattr(c, "behaviour_cap") else 1.0
            if kind == "masked_is":
                r = math.exp(lt - mt)
                keep = c.mask_low <= r <= c.mask_high
                v, g = (-r * a, -r * a) if keep else (0.0, 0.0)
            elif kind == "ppo_clip":
                r = math.exp(lt - old[t])
                s, ds = _ppo(r, a, 1 - c.clip_low, 1 + c.clip_high)
                v, g = -w * s, -w * ds * r
            elif kind == "tis":
                rho = min(math.exp(lt - mt), c.cap)
                v, g = -rho * a, -rho * a
            elif kind == "mis":
                rho = math.exp(seq_mean)
                keep = c.mask_low <= rho <= c.mask_high
                v, g = (-rho * a, -rho * a) if keep else (0.0, 0.0)
            elif kind == "icepop":
                k = math.exp((p[i][t] if proximal else lt) - mt)
                if not c.mask_low <= k <= c.mask_high:
                    v, g = 0.0, 0.0
                elif proximal:
                    r = math.exp(lt - p[i][t])
                    s, ds = _ppo(r, a, 1 - c.clip_low, 1 + c.clip_high)
                    v, g = -k * s, -k * ds * r
                else:
                    v, g = -k * a, -k * a
            elif kind == "cispo":
                r = min(max(math.exp(lt - old[t]), c.ratio_min), c.ratio_max)
                v, g = -w * r * a * lt, -w * r * a
            elif kind == "gspo":
                s_i = math.exp(seq_mean)  # s_it = sg(s_i) pi(y_t) / sg(pi(y_t)): value s_i, d/dl = s_i
                s, ds = _ppo(s_i, a, 1 - c.clip_low, 1 + c.clip_high)
                v, g = -w * s, -w * ds * s_i
            else:  # ipo
                r = math.exp(lt - mt)
                keep = abs(math.exp(lt) - math.exp(mt)) <= c.threshold
                v = -(c.adv_tau * a * r if keep else 0.0) + c.kl_tau * (lt - mt) ** 2
                g = -(c.adv_tau * a * r if keep else 0.0) + 2 * c.kl_tau * (lt - mt)
            value[i][t], grad[i][t] = v, g
    return value, grad


def reference_weights(cfg: dict[str, Any], mask, counts: tuple[float, float]) -> list[list[float]]:
    """objective.py's aggregation weights: 1/N, 1/(|y_i| S) or 1/(C S)."""
    n, s = counts
    out = []
    for row in mask:
        length = sum(1 for x in row if x)
        if cfg.get("aggregation", "token_mean") == "token_mean":
            w = 1 / n
        elif cfg["aggregation"] == "sequence_mean":
            w = 1 / (length * s) if length else 0.0
        else:
            w = 1 / (cfg["constant_tokens"] * s)
        out.append([w if x else 0.0 for x in row])
    return out


# ---------------------------------------------------------------- data and the objective


def _data(seed: int = 0, rows: int = 5):
    """Logits (the model input), targets, sampler and proximal logprobs near the trainer's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, MASK.shape[1], VOCAB, generator=g, dtype=F64)
    targets = torch.randint(0, VOCAB, (rows, MASK.shape[1]), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    sampler = lp + 0.25 * torch.randn(lp.shape, generator=g, dtype=F64)
    proximal = lp - 0.15 * torch.randn(lp.shape, generator=g, dtype=F64)
    return logits, targets, sampler.clamp(max=-1e-3), proximal.clamp(max=-1e-3)


def _config(cfg: dict[str, Any], **trainer: Any) -> TrainerConfig:
    steps = {"mini_batches": 2} if cfg.get("old_policy") == "proximal" else {}
    return TrainerConfig(loss=cfg, **steps, **trainer)


@functools.cache
def _objective(key: str) -> Objective:
    """One Objective per configuration (resolving a loss reads the installed entry points: slow to repeat)."""
    return Objective(_config(json.loads(key)))


def _scores(logits, targets, sampler, proximal, mask=MASK, adv=ADV, **extra) -> TokenScores:
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    rows = mask.shape[0]
    return TokenScores(
        logprobs=lp,
        sampler_logprobs=sampler,
        advantages=adv[:, None].expand_as(mask),
        loss_mask=mask,
        sequence=torch.arange(rows)[:, None].expand_as(mask).clone(),
        proximal_logprobs=proximal,
        **extra,
    )


def _counts(mask: torch.Tensor) -> StepCounts:
    return StepCounts(float(mask.sum()), float((mask.sum(1) > 0).sum()))


def _run(cfg: dict[str, Any], *data, mask=MASK, adv=ADV, counts=None):
    logits = data[0].clone().requires_grad_(True)
    s = _scores(logits, *data[1:], mask=mask, adv=adv)
    s.logprobs.retain_grad()
    loss, stats = _objective(json.dumps(cfg, sort_keys=True))(s, counts or _counts(mask))
    loss.backward()
    return loss.detach(), s.logprobs.grad, logits.grad, stats


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: a["aggregation"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_objective_matches_the_published_formula_and_its_gradients(case, agg):
    cfg = {**case[1], **agg}
    logits, targets, sampler, proximal = _data()
    loss, grad_l, grad_logits, stats = _run(cfg, logits, targets, sampler, proximal)

    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    value, dterm = reference_terms(cfg, lp.tolist(), sampler.tolist(), proximal.tolist(), ADV.tolist(), MASK.tolist())
    weights = reference_weights(cfg, MASK.tolist(), (float(MASK.sum()), 4.0))
    pairs = list(zip(weights, value, dterm, strict=True))
    expected = sum(w * v for wr, vr, _ in pairs for w, v in zip(wr, vr, strict=True))
    expected_grad = torch.tensor([[w * g for w, g in zip(wr, gr, strict=True)] for wr, _, gr in pairs], dtype=F64)
    assert math.isclose(float(loss), expected, rel_tol=1e-12, abs_tol=1e-14)
    torch.testing.assert_close(grad_l, expected_grad, rtol=1e-12, atol=1e-14)
    # through log_softmax to the model input: d loss / d logits = d loss / d l (onehot - softmax)
    onehot = torch.nn.functional.one_hot(targets, VOCAB).to(F64)
    chain = expected_grad[..., None] * (onehot - torch.softmax(logits, -1))
    torch.testing.assert_close(grad_logits, chain, rtol=1e-12, atol=1e-14)
    assert stats["tokens"] == stats["valid_tokens"] == float(MASK.sum())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_case_exercises_its_clip_or_mask_and_reports_it(case):
    """The parity data reaches both sides of each variant's clip or mask (else the parity proves less)."""
    logits, targets, sampler, proximal = _data()
    *_, stats = _run(case[1], logits, targets, sampler, proximal)
    acted = stats["dropped"] + stats["clipped"]
    assert 0 < acted < stats["tokens"], stats
    metrics = step_metrics(stats, 1)
    assert 0 < metrics["masked_fraction"] + metrics["clipped_fraction"] < 1
    assert metrics["ratio_min"] <= metrics["ratio_mean"] <= metrics["ratio_max"]
    assert metrics["sampler_kl"] > 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_ratio_reported_is_the_one_the_variant_weighs_with(case):
    cfg = case[1]
    _, targets, sampler, proximal = _data()
    lp = sampler + 0.1
    inputs = LossInputs(
        lp,
        sampler,
        proximal,
        ADV[:, None].expand_as(MASK),
        MASK > 0,
        _scores(_data()[0], targets, sampler, proximal).sequence,
        5,
    )
    objective = _objective(json.dumps(cfg, sort_keys=True))
    ratio = objective.spec.fn(inputs, objective.params).ratio
    on = MASK > 0
    old = {"icepop": proximal if cfg.get("old_policy") == "proximal" else lp}.get(cfg["type"])
    if cfg["type"] in ("mis", "gspo"):
        base = proximal if cfg.get("old_policy") == "proximal" else sampler
        expected = torch.exp(inputs.per_token(inputs.sequence_mean(lp - base)))
    elif old is not None:
        expected = torch.exp(old - sampler)
    else:
        base = proximal if cfg.get("old_policy") == "proximal" else sampler
        expected = torch.exp(lp - base)
    torch.testing.assert_close(ratio[on], expected[on], rtol=1e-12, atol=0)
    assert not ratio.requires_grad


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: a["aggregation"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_accumulated_micro_batches_equal_the_full_batch(case, agg):
    cfg = {**case[1], **agg}
    logits, targets, sampler, proximal = _data()
    counts = _counts(MASK)
    full, _, grad_full, _ = _run(cfg, logits, targets, sampler, proximal, counts=counts)
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 5)):
        loss, _, g, _ = _run(
            cfg,
            logits[rows],
            targets[rows],
            sampler[rows],
            proximal[rows],
            mask=MASK[rows],
            adv=ADV[rows],
            counts=counts,
        )
        total += float(loss)
        grads.append(g)
    assert math.isclose(total, float(full), rel_tol=1e-12, abs_tol=1e-14)
    torch.testing.assert_close(torch.cat(grads), grad_full, rtol=1e-12, atol=1e-15)


def test_the_sequence_level_variants_are_flagged_and_the_proximal_ones_read_it():
    for name, model in BUILTIN_LOSSES.items():
        spec, params = resolve(model())
        assert spec.params is model and params == model()
        assert spec.sequence_level == (name in SEQUENCE_LEVEL)
        assert spec.uses_proximal(params) is False
        if "old_policy" in model.model_fields:
            assert spec.uses_proximal(model(old_policy="proximal")) is True


# ---------------------------------------------------------------- edge cases, every variant


def _fn_terms(cfg, lp, sampler, proximal, mask, adv):
    spec, params = _objective(json.dumps(cfg, sort_keys=True)).spec, _objective(json.dumps(cfg, sort_keys=True)).params
    seq = torch.arange(mask.shape[0])[:, None].expand_as(mask).clone()
    x = LossInputs(
        lp, sampler, proximal, adv[:, None].expand_as(mask), mask > 0, torch.where(mask > 0, seq, -1), mask.shape[0]
    )
    return spec.fn(x, params)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_overflowing_log_ratio_keeps_the_terms_finite_and_zero_off_the_mask(case, dtype):
    logits, targets, sampler, proximal = (t.to(dtype) if t.is_floating_point() else t for t in _data())
    sampler = sampler.clone()
    sampler[0, 2] = -120.0  # l - m ~ +100 (m = log of ~1e-52)
    sampler[1, 3] = 0.0  # and a sampler logprob 0 ...
    logits = logits.clone()
    logits[1, 3] = -200.0
    logits[1, 3, targets[1, 3]] = -100.0 - math.log(VOCAB - 1)  # ... with l ~ -100: l - m ~ -100
    proximal = proximal.clone()
    proximal[0, 2], proximal[1, 3] = sampler[0, 2] + 80.0, -90.0  # the proximal ratios overflow too
    big = logits.clone()
    big[MASK == 0] = 1e4  # arbitrary values off the mask
    for agg in AGGREGATIONS:
        loss, grad_l, grad_logits, stats = _run({**case[1], **agg}, big, targets, sampler, proximal)
        assert torch.isfinite(loss), agg
        assert torch.isfinite(grad_l).all() and torch.isfinite(grad_logits).all()
        assert (grad_l[MASK == 0] == 0).all()
        assert math.isfinite(stats["ratio_sum"]) and math.isfinite(stats["sampler_kl_sum"])
    lp = torch.log_softmax(big, -1).gather(-1, targets[..., None])[..., 0].requires_grad_(True)
    terms = _fn_terms(case[1], lp, torch.where(MASK > 0, sampler, lp.detach()), proximal, MASK, ADV.to(dtype))
    assert (terms.per_token[MASK == 0] == 0).all()
    assert torch.isfinite(terms.per_token).all() and torch.isfinite(terms.ratio).all()


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")], ids=["-inf", "nan"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_nonfinite_sampler_logprob_is_dropped_and_counted(case, bad):
    logits, targets, sampler, proximal = _data()
    broken = sampler.clone()
    broken[0, 3] = broken[1, 2] = bad
    without = MASK.clone()
    without[0, 3] = without[1, 2] = 0.0
    counts = _counts(MASK)  # token_mean: the same weight 1/N, so the sums compare exactly
    loss, grad_l, grad_logits, stats = _run(case[1], logits, targets, broken, proximal, counts=counts)
    ref_loss, ref_grad_l, ref_grad_logits, ref_stats = _run(
        case[1], logits, targets, sampler, proximal, mask=without, counts=counts
    )
    assert torch.isfinite(loss) and torch.isfinite(grad_l).all() and torch.isfinite(grad_logits).all()
    assert grad_l[0, 3] == 0 and grad_l[1, 2] == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad_logits, ref_grad_logits, rtol=1e-14, atol=0)
    assert stats["nonfinite"] == 2.0 and ref_stats["nonfinite"] == 0.0
    assert stats["tokens"] == float(MASK.sum()) and stats["valid_tokens"] == float(without.sum())
    assert stats["dropped"] == ref_stats["dropped"] + 2.0  # no gradient: counted in masked_fraction
    assert step_metrics(stats, 2)["sampler_nonfinite_tokens"] == 1.0  # seen twice over two epochs
    assert math.isfinite(stats["sampler_kl_sum"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_zero_variance_group_gives_no_policy_gradient(case):
    logits, targets, sampler, proximal = _data()
    zero = torch.zeros_like(ADV)
    for agg in AGGREGATIONS:
        loss, grad_l, _, _ = _run({**case[1], **agg}, logits, targets, sampler, proximal, adv=zero)
        if case[1]["type"] != "ipo":
            assert float(loss) == 0.0 and (grad_l == 0).all()
            continue
        # ipo keeps its squared log ratio: kl_tau (l - m)^2 on every token
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        w = torch.tensor(reference_weights(agg, MASK.tolist(), (float(MASK.sum()), 4.0)), dtype=F64)
        kl_tau = case[1]["kl_tau"]
        torch.testing.assert_close(loss, (w * kl_tau * (lp - sampler) ** 2).sum(), rtol=1e-12, atol=0)
        torch.testing.assert_close(grad_l, w * 2 * kl_tau * (lp - sampler), rtol=1e-12, atol=0)


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: a["aggregation"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_all_masked_sample_contributes_nothing_and_is_not_counted(case, agg):
    """Row 4 has no completion token: the objective of rows 0-3 alone equals the five rows' (S = 4 samples)."""
    cfg = {**case[1], **agg}
    logits, targets, sampler, proximal = _data()
    assert _counts(MASK) == StepCounts(float(MASK.sum()), 4.0)
    loss, _, grad, _ = _run(cfg, logits, targets, sampler, proximal)
    four, _, grad4, _ = _run(cfg, logits[:4], targets[:4], sampler[:4], proximal[:4], mask=MASK[:4], adv=ADV[:4])
    torch.testing.assert_close(loss, four, rtol=1e-14, atol=0)
    assert (grad[4] == 0).all()
    torch.testing.assert_close(grad[:4], grad4, rtol=1e-14, atol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_one_token_completion(case):
    """One sample of one token: the sequence ratios are the token's, and sequence_mean is the token's term."""
    mask = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]], dtype=F64)
    logits, targets, sampler, proximal = (t[3:4] for t in _data())
    adv = ADV[3:4]
    results = [_run({**case[1], **agg}, logits, targets, sampler, proximal, mask=mask, adv=adv) for agg in AGGREGATIONS]
    (tok_loss, tok_grad, *_), (seq_loss, seq_grad, *_), (const_loss, const_grad, *_) = results
    torch.testing.assert_close(tok_loss, seq_loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(tok_grad, seq_grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(const_loss * 8, tok_loss, rtol=1e-12, atol=0)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    value, _ = reference_terms(case[1], lp.tolist(), sampler.tolist(), proximal.tolist(), adv.tolist(), mask.tolist())
    assert math.isclose(float(tok_loss), value[0][5], rel_tol=1e-12, abs_tol=1e-15)
    assert torch.isfinite(tok_grad).all() and (tok_grad[mask == 0] == 0).all()


# ---------------------------------------------------------------- entropy and the reference KL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: a["aggregation"])
def test_entropy_bonus_and_reference_kl_through_the_objective(estimator, agg):
    logits, targets, sampler, _ = _data()
    g = torch.Generator().manual_seed(7)
    reference = sampler + 0.3 * torch.randn(sampler.shape, generator=g, dtype=F64)
    ent_coef, kl_coef = 0.03, 0.2
    tcfg = TrainerConfig(
        loss={"type": "tis", "cap": 1.3, "entropy_coef": ent_coef, **agg},
        reference={"kl_coef": kl_coef, "estimator": estimator},
    )
    objective = Objective(tcfg)
    assert objective.needs_entropy

    def run(with_extras: bool):
        x = logits.clone().requires_grad_(True)
        probs = torch.softmax(x, -1)
        entropy = -(probs * torch.log_softmax(x, -1)).sum(-1)
        s = _scores(x, targets, sampler, None, reference_logprobs=reference, entropy=entropy)
        if with_extras:
            loss, stats = objective(s, _counts(MASK))
        else:
            loss, stats = Objective(TrainerConfig(loss={"type": "tis", "cap": 1.3, **agg}))(s, _counts(MASK))
        loss.backward()
        return loss.detach(), x.grad, stats, s.logprobs.detach(), entropy.detach()

    loss, grad, stats, lp, entropy = run(True)
    base_loss, base_grad, _, _, _ = run(False)
    w = torch.tensor(reference_weights(agg, MASK.tolist(), (float(MASK.sum()), 4.0)), dtype=F64)
    d = lp - reference
    kl = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[estimator]
    dkl = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d)}[estimator]
    torch.testing.assert_close(loss, base_loss + (w * (kl_coef * kl - ent_coef * entropy)).sum(), rtol=1e-12, atol=0)
    # the extra gradient: kl_coef w dk/dl (onehot - softmax) - ent_coef w dH/dlogits
    x = logits.clone().requires_grad_(True)
    probs = torch.softmax(x, -1)
    (-(w * (probs * torch.log_softmax(x, -1)).sum(-1)).sum() * -ent_coef).backward()
    onehot = torch.nn.functional.one_hot(targets, VOCAB).to(F64)
    kl_grad = (kl_coef * w * dkl)[..., None] * (onehot - torch.softmax(logits, -1))
    torch.testing.assert_close(grad - base_grad, kl_grad + x.grad, rtol=1e-10, atol=1e-15)
    assert math.isclose(stats["ref_kl_sum"], float((kl * MASK).sum()), rel_tol=1e-12)
    assert math.isclose(stats["entropy_sum"], float((entropy * MASK).sum()), rel_tol=1e-12)
    metrics = step_metrics(stats, 1)
    assert math.isclose(metrics["ref_kl"], float((kl * MASK).sum() / MASK.sum()), rel_tol=1e-12)
    assert math.isclose(metrics["entropy"], float((entropy * MASK).sum() / MASK.sum()), rel_tol=1e-12)


# ---------------------------------------------------------------- what the config refuses


@pytest.mark.parametrize(
    ("trainer", "names"),
    [
        ({"loss": {"type": "ppo_clip", "old_policy": "proximal"}}, ["old_policy", "mini_batches", "epochs"]),
        ({"loss": {"type": "gspo", "old_policy": "proximal"}, "epochs": 1}, ["old_policy"]),
        ({"loss": {"type": "mis"}, "parallel": {"world_size": 2, "cp": 2}}, ["'mis'", "parallel.cp"]),
        ({"loss": {"type": "gspo"}, "parallel": {"world_size": 2, "cp": 2}}, ["'gspo'", "parallel.cp"]),
        (
            {"loss": {"type": "tis", "aggregation": "sequence_mean"}, "parallel": {"world_size": 2, "cp": 2}},
            ["sequence_mean", "parallel.cp"],
        ),
        ({"loss": {"aggregation": "constant"}}, ["constant_tokens"]),
        ({"loss": {"constant_tokens": 8}}, ["constant_tokens"]),
        ({"reference": {"model": "/models/ref"}}, ["reference.model", "kl_coef"]),
    ],
)
def test_config_refusals_name_the_key(trainer, names):
    with pytest.raises(ValidationError) as err:
        TrainerConfig(**trainer)
    for name in names:
        assert name in str(err.value)


def test_what_the_config_accepts():
    TrainerConfig(loss={"type": "ppo_clip", "old_policy": "proximal"}, mini_batches=2)
    TrainerConfig(loss={"type": "cispo", "old_policy": "proximal"}, epochs=2)
    TrainerConfig(loss={"type": "tis"}, parallel={"world_size": 2, "cp": 2})  # token level, token_mean
    TrainerConfig(loss={"aggregation": "constant", "constant_tokens": 64})
    TrainerConfig(reference={"model": "/models/ref", "kl_coef": 0.01})
