"""policy_loss / k3_kl in engines/trainer/loss.py: gradients, trust-region masking, counts."""

from __future__ import annotations

import math

import torch

from engines.trainer.loss import k3_kl, policy_loss

MASK_LOW, MASK_HIGH = 0.5, 2.0


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


def test_on_policy_gradient_is_minus_advantage_over_n():
    sampler, adv, mask = _inputs()
    logprobs = sampler.clone().requires_grad_(True)
    n = float(mask.sum()) + 5.0  # the step-wide normalizer may exceed this micro-batch's tokens
    out = policy_loss(logprobs, sampler, adv, mask, MASK_LOW, MASK_HIGH, n)
    out.loss.backward()
    expected = -adv[:, None] * mask / n
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-7)
    assert out.masked_tokens == 0.0
    assert out.tokens == float(mask.sum())
    assert abs(out.sampler_kl_sum) < 1e-6
    # on-policy the loss value itself is -sum(A * tokens) / N
    torch.testing.assert_close(out.loss, -(adv[:, None] * mask).sum() / n)


def test_off_policy_gradient_is_importance_weighted():
    sampler, adv, mask = _inputs()
    shift = torch.full_like(sampler, math.log(1.5))  # ratio 1.5: inside the trust region
    logprobs = (sampler + shift).requires_grad_(True)
    n = float(mask.sum())
    out = policy_loss(logprobs, sampler, adv, mask, MASK_LOW, MASK_HIGH, n)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, -1.5 * adv[:, None] * mask / n, rtol=1e-5, atol=1e-7)
    assert out.masked_tokens == 0.0
    k3 = 1.5 - 1 - math.log(1.5)
    assert math.isclose(out.sampler_kl_sum, k3 * n, rel_tol=1e-4)


def test_tokens_outside_trust_region_get_zero_gradient_and_are_counted():
    sampler, adv, mask = _inputs()
    log_r = torch.zeros_like(sampler)
    log_r[0, 2] = math.log(3.0)  # ratio 3.0 > mask_high
    log_r[1, 4] = math.log(0.2)  # ratio 0.2 < mask_low
    log_r[2, 3] = math.log(1.9)  # inside
    log_r[1, 0] = math.log(10.0)  # outside but loss_mask 0: not counted
    logprobs = (sampler + log_r).requires_grad_(True)
    n = float(mask.sum())
    out = policy_loss(logprobs, sampler, adv, mask, MASK_LOW, MASK_HIGH, n)
    out.loss.backward()
    grad = logprobs.grad
    assert grad[0, 2] == 0 and grad[1, 4] == 0
    assert out.masked_tokens == 2.0
    assert out.tokens == float(mask.sum())
    torch.testing.assert_close(grad[2, 3], -1.9 * adv[2] / n)
    torch.testing.assert_close(grad[0, 3], -adv[0] / n)
    kept = mask.clone()
    kept[0, 2] = kept[1, 4] = 0
    assert int((grad != 0).sum()) == int(kept.sum())


def test_loss_mask_zero_positions_get_zero_gradient():
    sampler, adv, mask = _inputs()
    g = torch.Generator().manual_seed(1)
    # arbitrary trainer logprobs, including huge ratios at the positions outside the loss mask
    logprobs = (sampler + 0.3 * torch.randn(sampler.shape, generator=g) + 20.0 * (1 - mask)).requires_grad_(True)
    out = policy_loss(logprobs, sampler, adv, mask, MASK_LOW, MASK_HIGH, float(mask.sum()))
    out.loss.backward()
    assert torch.all(logprobs.grad[mask == 0] == 0)
    assert torch.isfinite(out.loss)
    assert math.isfinite(out.sampler_kl_sum)
    assert torch.any(logprobs.grad[mask == 1] != 0)


def test_ratios_just_inside_the_region_are_kept():
    sampler = torch.zeros(1, 2)
    logprobs = torch.tensor([[math.log(MASK_LOW) + 1e-4, math.log(MASK_HIGH) - 1e-4]])
    out = policy_loss(logprobs, sampler, torch.tensor([1.0]), torch.ones(1, 2), MASK_LOW, MASK_HIGH, 2.0)
    assert out.masked_tokens == 0.0
    outside = torch.tensor([[math.log(MASK_LOW) - 1e-4, math.log(MASK_HIGH) + 1e-4]])
    out = policy_loss(outside, sampler, torch.tensor([1.0]), torch.ones(1, 2), MASK_LOW, MASK_HIGH, 2.0)
    assert out.masked_tokens == 2.0
    assert float(out.loss) == 0.0


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


def _grad_of(logprobs, sampler, adv, mask):
    lp = logprobs.clone().requires_grad_(True)
    out = policy_loss(lp, sampler, adv, mask, 0.5, 2.0, 8.0)
    out.loss.backward()
    return out, lp.grad


def test_overflowing_ratio_or_minus_inf_sampler_logprob_gives_zero_loss_and_gradient_for_that_token():
    torch.manual_seed(0)
    logprobs = -torch.rand(2, 4)
    sampler = logprobs + 0.01 * torch.randn(2, 4)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 4)
    without = mask.clone()
    without[0, 1] = without[1, 2] = 0.0
    ref_out, ref_grad = _grad_of(logprobs, sampler, adv, without)
    bad = sampler.clone()
    bad[0, 1] = logprobs[0, 1] - 100.0  # log ratio 100: exp overflows float32
    bad[1, 2] = float("-inf")  # what an external engine may return
    out, grad = _grad_of(logprobs, bad, adv, mask)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(out.loss, ref_out.loss)
    assert torch.equal(grad, ref_grad)
    assert grad[0, 1] == 0 and grad[1, 2] == 0
    assert out.nonfinite_tokens == 1.0
    assert out.masked_tokens == 2.0  # both offending tokens are outside the kept set
    assert math.isfinite(out.sampler_kl_sum)


def test_k3_kl_stays_finite_and_skips_nonfinite_reference_logprobs():
    logprobs = torch.zeros(1, 3)
    ref = torch.tensor([[0.0, -100.0, float("nan")]])
    total, tokens = k3_kl(logprobs, ref, torch.ones(1, 3))
    assert math.isfinite(total)
    assert tokens == 2.0
