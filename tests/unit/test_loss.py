"""The default loss (masked_is) through the trainer's `Objective` on a real `Batch` (token_scores / counts_of):
gradients, trust-region masking, counts, non-finite sampler logprobs, micro-batch accumulation; kl.py's k3."""

from __future__ import annotations

import math

import pytest
import torch

from config.trainer import TrainerConfig
from engines.trainer.batch import Batch
from engines.trainer.losses.kl import k3_kl
from engines.trainer.losses.objective import Objective, StepCounts, counts_of, step_metrics, token_scores

MASK_LOW, MASK_HIGH = 0.5, 2.0
OBJECTIVE = Objective(TrainerConfig(loss={"type": "masked_is", "mask_low": MASK_LOW, "mask_high": MASK_HIGH}))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(sampler: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor) -> Batch:
    b, t = loss_mask.shape
    return Batch(
        input_ids=torch.zeros(b, t + 1, dtype=torch.long),
        targets=torch.zeros(b, t, dtype=torch.long),
        loss_mask=loss_mask,
        sampler_logprobs=sampler,
        advantages=advantages,
        temperatures=torch.ones(b),
        versions=torch.zeros(b, dtype=torch.long),
        versions_end=torch.zeros(b, dtype=torch.long),
    )


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 6
    sampler = -torch.rand(b, t, generator=g) * 3 - 0.1
    advantages = torch.tensor([1.5, -0.7, 0.3])
    loss_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 0],
            [0, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 0],
        ],
        dtype=torch.float32,
    )
    return sampler, advantages, loss_mask


def _loss(logprobs, sampler, adv, mask, counts: StepCounts | None = None, objective=OBJECTIVE):
    """(loss, d loss / d logprobs, stats) of one micro-batch taken as the whole step unless `counts` says."""
    lp = logprobs.clone().requires_grad_(True)
    mb = _batch(sampler, adv, mask)
    loss, stats = objective(token_scores(mb, lp), counts or counts_of(mb))
    loss.backward()
    return loss.detach(), lp.grad, stats


def test_counts_of_a_batch():
    sampler, adv, mask = _inputs()
    assert counts_of(_batch(sampler, adv, mask)) == StepCounts(float(mask.sum()), 3.0)
    mask[1] = 0.0  # a sample without completion tokens is not counted
    assert counts_of(_batch(sampler, adv, mask)) == StepCounts(float(mask.sum()), 2.0)


def test_on_policy_gradient_is_minus_advantage_over_n():
    sampler, adv, mask = _inputs()
    n = float(mask.sum()) + 5.0  # the step-wide normalizer may exceed this micro-batch's tokens
    loss, grad, stats = _loss(sampler, sampler, adv, mask, StepCounts(n, 3.0))
    expected = -adv[:, None] * mask / n
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-7)
    assert stats["dropped"] == 0.0
    assert stats["tokens"] == float(mask.sum())
    assert abs(stats["sampler_kl_sum"]) < 1e-6
    # on-policy the loss value itself is -sum(A * tokens) / N
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / n)


def test_off_policy_gradient_is_importance_weighted():
    sampler, adv, mask = _inputs()
    shift = torch.full_like(sampler, math.log(1.5))  # ratio 1.5: inside the trust region
    loss, grad, stats = _loss(sampler + shift, sampler, adv, mask)
    n = float(mask.sum())
    torch.testing.assert_close(grad, -1.5 * adv[:, None] * mask / n, rtol=1e-5, atol=1e-7)
    assert stats["dropped"] == 0.0
    k3 = 1.5 - 1 - math.log(1.5)
    assert math.isclose(stats["sampler_kl_sum"], k3 * n, rel_tol=1e-4)
    assert math.isclose(step_metrics(stats, 1)["ratio_mean"], 1.5, rel_tol=1e-5)


def test_tokens_outside_trust_region_get_zero_gradient_and_are_counted():
    sampler, adv, mask = _inputs()
    log_r = torch.zeros_like(sampler)
    log_r[0, 2] = math.log(3.0)  # ratio 3.0 > mask_high
    log_r[1, 4] = math.log(0.2)  # ratio 0.2 < mask_low
    log_r[2, 3] = math.log(1.9)  # inside
    log_r[1, 0] = math.log(10.0)  # outside but loss_mask 0: not counted
    _, grad, stats = _loss(sampler + log_r, sampler, adv, mask)
    n = float(mask.sum())
    assert grad[0, 2] == 0 and grad[1, 4] == 0
    assert stats["dropped"] == 2.0
    assert stats["tokens"] == n
    assert math.isclose(step_metrics(stats, 1)["masked_fraction"], 2.0 / n)
    torch.testing.assert_close(grad[2, 3], -1.9 * adv[2] / n)
    torch.testing.assert_close(grad[0, 3], -adv[0] / n)
    kept = mask.clone()
    kept[0, 2] = kept[1, 4] = 0
    assert int((grad != 0).sum()) == int(kept.sum())


def test_loss_mask_zero_positions_get_zero_gradient():
    sampler, adv, mask = _inputs()
    g = torch.Generator().manual_seed(1)
    # arbitrary trainer logprobs, including huge ratios at the positions outside the loss mask
    logprobs = sampler + 0.3 * torch.randn(sampler.shape, generator=g) + 20.0 * (1 - mask)
    loss, grad, stats = _loss(logprobs, sampler, adv, mask)
    assert torch.all(grad[mask == 0] == 0)
    assert torch.isfinite(loss)
    assert math.isfinite(stats["sampler_kl_sum"])
    assert torch.any(grad[mask == 1] != 0)


def test_ratios_just_inside_the_region_are_kept():
    sampler = torch.zeros(1, 2)
    inside = torch.tensor([[math.log(MASK_LOW) + 1e-4, math.log(MASK_HIGH) - 1e-4]])
    _, _, stats = _loss(inside, sampler, torch.tensor([1.0]), torch.ones(1, 2))
    assert stats["dropped"] == 0.0
    outside = torch.tensor([[math.log(MASK_LOW) - 1e-4, math.log(MASK_HIGH) + 1e-4]])
    loss, _, stats = _loss(outside, sampler, torch.tensor([1.0]), torch.ones(1, 2))
    assert stats["dropped"] == 2.0
    assert float(loss) == 0.0


def test_overflowing_ratio_or_nonfinite_sampler_logprob_gives_zero_loss_and_gradient_for_that_token():
    torch.manual_seed(0)
    logprobs = -torch.rand(2, 4)
    sampler = logprobs + 0.01 * torch.randn(2, 4)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 4)
    without = mask.clone()
    without[0, 1] = without[1, 2] = without[1, 3] = 0.0
    counts = StepCounts(8.0, 2.0)
    ref_loss, ref_grad, _ = _loss(logprobs, sampler, adv, without, counts)
    bad = sampler.clone()
    bad[0, 1] = logprobs[0, 1] - 100.0  # log ratio 100: exp overflows float32
    bad[1, 2] = float("-inf")  # what an external engine may return
    bad[1, 3] = float("nan")
    loss, grad, stats = _loss(logprobs, bad, adv, mask, counts)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    assert grad[0, 1] == 0 and grad[1, 2] == 0 and grad[1, 3] == 0
    assert stats["nonfinite"] == 2.0
    assert stats["dropped"] == 3.0  # the three offending tokens are all outside the kept set
    assert math.isfinite(stats["sampler_kl_sum"]) and math.isfinite(stats["ratio_sum"])
    assert step_metrics(stats, 1)["sampler_nonfinite_tokens"] == 2.0


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_accumulate_to_the_full_batch(aggregation):
    sampler, adv, mask = _inputs()
    g = torch.Generator().manual_seed(3)
    logprobs = sampler + 0.4 * torch.randn(sampler.shape, generator=g)
    extra = {"constant_tokens": 6} if aggregation == "constant" else {}
    objective = Objective(TrainerConfig(loss={"aggregation": aggregation, **extra}))
    full = _batch(sampler, adv, mask)
    counts = counts_of(full)
    loss, grad, stats = _loss(logprobs, sampler, adv, mask, counts, objective)
    total, grads, dropped = torch.zeros(()), [], 0.0
    for rows in (slice(0, 1), slice(1, 3)):
        part_loss, part_grad, part_stats = _loss(
            logprobs[rows], sampler[rows], adv[rows], mask[rows], counts, objective
        )
        total, dropped = total + part_loss, dropped + part_stats["dropped"]
        grads.append(part_grad)
    torch.testing.assert_close(total, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads), grad, rtol=1e-6, atol=1e-8)
    assert dropped == stats["dropped"]


def test_k3_kl():
    sampler, _, mask = _inputs()
    s, n = k3_kl(sampler, sampler, mask)
    assert abs(s) < 1e-7 and n == float(mask.sum())
    g = torch.Generator().manual_seed(2)
    other = sampler + 0.5 * torch.randn(sampler.shape, generator=g)
    s2, n2 = k3_kl(other, sampler, mask)
    assert s2 > 1e-3 and n2 == n
    # k3 is nonnegative per token, so differences only outside the mask contribute nothing
    s3, _ = k3_kl(sampler + 5.0 * (1 - mask), sampler, mask)
    assert abs(s3) < 1e-7
    # matches the closed form sum(r - 1 - log r)
    log_r = (other - sampler) * mask
    expected = float(((log_r.exp() - 1 - log_r) * mask).sum())
    assert math.isclose(s2, expected, rel_tol=1e-6)


def test_k3_kl_stays_finite_and_skips_nonfinite_reference_logprobs():
    logprobs = torch.zeros(1, 3)
    ref = torch.tensor([[0.0, -100.0, float("nan")]])
    total, tokens = k3_kl(logprobs, ref, torch.ones(1, 3))
    assert math.isfinite(total)
    assert tokens == 2.0
