"""Group-relative advantages and the staleness rule (engines/orchestrator/advantages.py)."""

from __future__ import annotations

import statistics

import pytest

from engines.orchestrator.advantages import group_advantages, with_group_advantages
from storage.rollouts import RolloutRow, staleness


@pytest.mark.parametrize("rewards", [[0.0, 1.0], [0.1, 0.5, 0.9, 0.2], [1.0, 1.0, 1.0, 0.0, 0.3, 0.7, 0.25, 0.6]])
def test_normalized_advantages_have_zero_mean_unit_std(rewards):
    adv = group_advantages(rewards, normalize=True)
    assert len(adv) == len(rewards)
    assert abs(statistics.fmean(adv)) < 1e-9
    assert abs(statistics.pstdev(adv) - 1.0) < 1e-3  # eps keeps it just under 1
    # an affine map of the rewards with positive slope: order and ties are preserved
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if rewards[i] < rewards[j]:
                assert adv[i] < adv[j]
            elif rewards[i] == rewards[j]:
                assert adv[i] == adv[j]


def test_equal_rewards_give_zero_advantages():
    for normalize in (True, False):
        assert group_advantages([0.7] * 8, normalize=normalize) == [0.0] * 8


def test_unnormalized_keeps_scale():
    rewards = [0.0, 0.5, 1.0, 2.5]
    adv = group_advantages(rewards, normalize=False)
    mean = sum(rewards) / len(rewards)
    assert adv == pytest.approx([r - mean for r in rewards])
    scaled = group_advantages([10 * r for r in rewards], normalize=False)
    assert scaled == pytest.approx([10 * a for a in adv])
    # normalized advantages are scale invariant
    assert group_advantages([10 * r for r in rewards], normalize=True) == pytest.approx(
        group_advantages(rewards, normalize=True), rel=1e-3
    )


def test_tiny_spread_does_not_blow_up():
    adv = group_advantages([0.5, 0.5 + 1e-9], normalize=True)
    assert all(abs(a) < 1e-3 for a in adv)


def test_staleness():
    # step N (1-based) trains policy N-1 into version N; samples from version N-1 are fresh
    assert staleness(1, 0) == 0
    assert staleness(5, 4) == 0
    assert staleness(5, 3) == 1
    assert staleness(5, 2) == 2
    assert staleness(10, 0) == 9


def _scored(k: int, reward: float) -> RolloutRow:
    """A row as an environment returns it: scored, no advantage given."""
    return RolloutRow(
        run_id="r", step=1, sample_id=f"s-{k}", group_id="g", env="e", policy_version=0, policy_version_end=0,
        prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.5], reward=reward, temperature=1.0,
        finish_reason="stop", prompt_text="p", completion_text="c",
    )  # fmt: skip


@pytest.mark.parametrize("normalize", [True, False])
def test_the_orchestrator_sets_a_scored_groups_advantages_from_its_rewards(normalize):
    rewards = [0.25, 1.0, 0.0, 0.6]
    rows = [_scored(k, r) for k, r in enumerate(rewards)]
    assert {r.advantage for r in rows} == {0.0}
    assert with_group_advantages(rows, normalize) is rows
    assert [r.advantage for r in rows] == group_advantages(rewards, normalize)
    assert [r.reward for r in rows] == rewards
