"""Evaluation metrics: pass@k against brute force over every k-subset, the stable product at sizes where the
binomials overflow, the normal interval, and a summary's per-environment and flat `eval/` keys."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from engines.orchestrator.eval_metrics import Z95, normal_ci, pass_at_k, summarize


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_where_binomials_overflow():
    # C(2000, 1000) does not fit a float: the product form never builds the binomials
    with pytest.raises(OverflowError):
        float(math.comb(2000, 1000))
    exact = 1 - math.comb(2000 - 3, 1000) / math.comb(2000, 1000)  # int / int: Python divides exactly, then rounds
    assert pass_at_k(2000, 3, 1000) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(2000, 0, 1000) == 0.0 and pass_at_k(2000, 1001, 1000) == 1.0


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_normal_ci_is_mean_plus_minus_z_times_standard_error():
    values = [0.1, 0.4, 0.35, 0.8, 0.55]
    lo, hi = normal_ci(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values))
    assert (lo, hi) == pytest.approx((statistics.mean(values) - half, statistics.mean(values) + half))
    assert normal_ci([0.3]) is None and normal_ci([0.5, 0.5]) == pytest.approx((0.5, 0.5))


def test_summary_per_env_and_flat_keys():
    rows = [("a", 0, 1.0, True), ("a", 0, 0.0, False), ("a", 1, 0.5, False), ("a", 1, 0.5, False)]
    rows += [("b", 0, 1.0, True), ("b", 0, 1.0, True)]
    s = summarize(rows, ["a", "b"], [1, 2])
    a, b = s["envs"]["a"], s["envs"]["b"]
    assert a["tasks"] == 2 and a["samples"] == 4 and a["reward_mean"] == pytest.approx(0.5)
    assert a["pass@1"] == pytest.approx((0.5 + 0.0) / 2) and a["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert b["pass@2"] == 1.0 and b["reward_ci95"] is None  # one task: no interval
    assert s["reward_mean"] == pytest.approx((0.5 + 1.0) / 2)  # the mean of the environments' means
    assert s["metrics"] == {
        "eval/reward_mean": s["reward_mean"],
        "eval/a/reward_mean": a["reward_mean"],
        "eval/a/pass@1": a["pass@1"],
        "eval/a/pass@2": a["pass@2"],
        "eval/b/reward_mean": 1.0,
        "eval/b/pass@1": 1.0,
        "eval/b/pass@2": 1.0,
    }


def test_paired_difference_is_the_mean_change_per_task_with_its_interval():
    from engines.orchestrator.eval_metrics import paired_difference, task_means

    before = task_means([("a", 0, 0.0), ("a", 0, 1.0), ("a", 1, 0.0), ("a", 2, 1.0), ("b", 0, 0.5)])
    after = task_means([("a", 0, 1.0), ("a", 1, 1.0), ("a", 2, 1.0), ("a", 3, 1.0), ("b", 0, 0.25)])
    out = paired_difference(before, after)
    assert out["a"]["tasks"] == 3 and out["a"]["difference"] == pytest.approx((0.5 + 1.0 + 0.0) / 3, abs=1e-12)
    diffs = [0.5, 1.0, 0.0]
    mean, s = sum(diffs) / 3, (sum((d - 0.5) ** 2 for d in diffs) / 2) ** 0.5
    assert out["a"]["ci95"] == pytest.approx(
        (mean - 1.959963984540054 * s / 3**0.5, mean + 1.959963984540054 * s / 3**0.5)
    )
    assert out["b"] == {"tasks": 1, "difference": -0.25, "ci95": None}  # one task: no interval
    assert out["all"]["tasks"] == 4 and out["all"]["difference"] == pytest.approx(1.25 / 4)
    with pytest.raises(ValueError, match="share no"):
        paired_difference(before, {("c", 0): 1.0})
