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


# The estimators as configuration (engines/orchestrator/advantages.py, estimators.py, overlong.py) ----------------
# Each built-in against the published formula written out directly, in float64, to 1e-12.

import math  # noqa: E402
import random  # noqa: E402

from config.advantage import AdvantageConfig, GrpoParams, OverlongConfig, ReinforcePPParams, RlooParams  # noqa: E402
from config.envs import EnvSpec  # noqa: E402
from engines.orchestrator.advantages import grpo, reinforce_pp, rloo  # noqa: E402
from engines.orchestrator.estimators import AdvantageError, StepEstimators  # noqa: E402
from engines.orchestrator.overlong import overlong_penalty, shaped_rewards  # noqa: E402


def _mean(xs):
    return math.fsum(xs) / len(xs)


def _pstd(xs):
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


def ref_grpo(groups, normalize_std=True, eps=1e-4):
    """Shao et al. 2024 (DeepSeekMath), outcome supervision: (r_i - mean(r)) / std(r), std + eps."""
    out = []
    for g in groups:
        m, s = _mean(g), _pstd(g)
        out.append([(r - m) / (s + eps) if normalize_std else r - m for r in g])
    return out


def ref_rloo(groups):
    """Kool et al. 2019; Ahmadian et al. 2024 eq. 6: r_i - 1/(k-1) sum_{j != i} r_j."""
    return [[g[i] - math.fsum(g[:i] + g[i + 1 :]) / (len(g) - 1) for i in range(len(g))] for g in groups]


def ref_reinforce_pp(groups, group_baseline=True, eps=1e-4):
    """Hu 2025 (REINFORCE++-baseline): r - mean_group(r), then (A - mean_batch(A)) / (std_batch(A) + eps)."""
    centred = [[r - _mean(g) for r in g] if group_baseline else list(g) for g in groups]
    flat = [a for g in centred for a in g]
    m, s = _mean(flat), _pstd(flat)
    return [[(a - m) / (s + eps) for a in g] for g in centred]


def _close(a, b, tol=1e-12):
    assert [len(g) for g in a] == [len(g) for g in b]
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert abs(x - y) <= tol * max(1.0, abs(y)), (a, b)


def _batches():
    rng = random.Random(3)
    yield [[0.0, 1.0]]  # a single group of size 2
    yield [[0.25, 0.5, 1.0, 0.0], [0.7] * 4, [1.0, 0.0]]  # a zero-variance group among others, ragged sizes
    yield [[rng.random() for _ in range(8)] for _ in range(16)]
    yield [[rng.choice([0.0, 1.0]) for _ in range(5)] for _ in range(7)]
    yield [[rng.gauss(3.0, 10.0) for _ in range(3)]]  # a single group, larger scale


@pytest.mark.parametrize("batch", list(_batches()))
def test_builtins_match_the_published_formulas(batch):
    for normalize in (True, False):
        _close(grpo(batch, GrpoParams(normalize_std=normalize)), ref_grpo(batch, normalize))
        _close(reinforce_pp(batch, ReinforcePPParams(group_baseline=normalize)), ref_reinforce_pp(batch, normalize))
    _close(rloo(batch, RlooParams()), ref_rloo(batch))
    _close(grpo(batch, GrpoParams(eps=0.5)), ref_grpo(batch, eps=0.5))


def test_default_grpo_is_bit_identical_to_the_group_estimator():
    rng = random.Random(0)
    for _ in range(200):
        group = [rng.random() * rng.choice([1.0, 7.0, 1e-3]) for _ in range(rng.randint(2, 9))]
        assert grpo([group], GrpoParams()) == [group_advantages(group, normalize=True)]
        assert grpo([group], GrpoParams(normalize_std=False)) == [group_advantages(group, normalize=False)]


def test_zero_variance_and_a_batch_of_equal_rewards():
    for rewards in ([0.7] * 8, [1.0] * 5, [0.0, 0.0], [0.1] * 6):
        assert rloo([rewards], RlooParams()) == [[0.0] * len(rewards)]  # exactly, whatever the rounding
        for baseline in (True, False):  # nothing to normalise by: eps keeps it finite, and it is exactly 0
            assert (
                reinforce_pp([rewards, rewards], ReinforcePPParams(group_baseline=baseline))
                == [[0.0] * len(rewards)] * 2
            )
    for rewards in ([0.7] * 8, [1.0] * 5, [0.0, 0.0]):  # where the mean is exact, as for 0/1 rewards
        assert grpo([rewards], GrpoParams()) == [[0.0] * len(rewards)]
    # a zero-variance group in a batch that does vary: rloo and grpo give it 0; reinforce_pp centres it at 0
    # and the batch normalisation keeps it there
    out = reinforce_pp([[0.5, 0.5], [0.0, 1.0]], ReinforcePPParams())
    assert out[0] == [0.0, 0.0] and out[1][0] < 0 < out[1][1]


def _row(env: str, k: int, reward: float, length: int = 1, mask: list[int] | None = None) -> RolloutRow:
    return RolloutRow(
        run_id="r", step=1, sample_id=f"{env}-{k}", group_id=env, env=env, policy_version=0, policy_version_end=0,
        prompt_ids=[1], completion_ids=[2] * length, completion_logprobs=[-0.5] * length, reward=reward,
        temperature=1.0, finish_reason="stop", prompt_text="p", completion_text="c", completion_mask=mask,
        turn_policy_versions=[0] if mask else None, turn_policy_versions_end=[0] if mask else None,
    )  # fmt: skip


def test_mixed_envs_each_by_its_estimator_batch_level_over_its_own_rows():
    envs = [
        EnvSpec(id="reverse-text", name="a"),  # the orchestrator's: rloo
        EnvSpec(id="reverse-text", name="b", advantage=AdvantageConfig(type="reinforce_pp")),
        EnvSpec(id="reverse-text", name="c", advantage=AdvantageConfig(type="reinforce_pp")),  # shares b's batch
        EnvSpec(id="reverse-text", name="d", advantage=AdvantageConfig(type="grpo", normalize_std=False)),
    ]
    est = StepEstimators(AdvantageConfig(type="rloo"), envs)
    spec = {"a": [[0.0, 1.0, 0.5]], "b": [[0.2, 0.9], [0.4, 0.4]], "c": [[1.0, 0.0, 0.3]], "d": [[0.3, 0.6]]}
    order = ["b", "a", "d", "c", "b"]  # interleaved as a step's groups are
    rewards = [spec["b"][0], spec["a"][0], spec["d"][0], spec["c"][0], spec["b"][1]]
    groups = [[_row(env, k, r) for k, r in enumerate(g)] for env, g in zip(order, rewards, strict=True)]
    zero = est.apply(groups, rewards)
    got = [[r.advantage for r in g] for g in groups]
    pp = ref_reinforce_pp([spec["b"][0], spec["c"][0], spec["b"][1]])  # b and c together, in step order
    _close([got[0], got[3], got[4]], pp)
    _close([got[1]], ref_rloo(spec["a"]))
    _close([got[2]], ref_grpo(spec["d"], normalize_std=False))
    assert zero == 1 and got[4] == [0.0, 0.0]


class _Spec:
    def __init__(self, fn):
        from engines.orchestrator.advantages import AdvantageSpec

        self.spec = AdvantageSpec(fn, RlooParams)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda g, p: g[:-1], "returned 1 groups for 2 groups"),
        (lambda g, p: [x[1:] for x in g], "returned 1 values for group 0, which has 2 rewards"),
        (lambda g, p: [[math.inf] * len(x) for x in g], "returned inf for group 0"),
        (lambda g, p: [["a"] * len(x) for x in g], "returned 'a' for group 0"),
        (lambda g, p: None, "returned a NoneType for 2 groups"),
        (lambda g, p: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_a_plugins_wrong_output_is_refused_naming_the_estimator(fn, message):
    from engines.orchestrator.estimators import Estimator

    est = Estimator("toy:bad", _Spec(fn).spec, RlooParams())
    with pytest.raises(AdvantageError, match="advantage estimator 'toy:bad'") as info:
        est([[0.0, 1.0], [1.0, 0.5]])
    assert message in str(info.value)


def test_overlong_penalty_follows_dapo():
    # L_max = 12, buffer 4: no penalty up to 8 tokens, a linear ramp to -penalty at 12, -penalty beyond
    assert [overlong_penalty(n, 12, 4, 1.0) for n in (1, 8, 9, 10, 12, 13)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(11, 12, 4, 0.5) == -0.375
    groups = [[_row("a", 0, 1.0, length=12), _row("a", 1, 0.5, length=3)], [_row("b", 0, 1.0, 5, mask=[1, 0, 1, 0, 1])]]
    rewards, skipped = shaped_rewards(groups, OverlongConfig(buffer=4, penalty=1.0), 12)
    assert rewards == [[0.0, 0.5], [1.0]] and skipped == 1  # the multi-turn row is left unshaped
    assert [(r.metric_names, r.metric_values) for r in groups[0]] == [(["overlong_penalty"], [-1.0])] + [
        (["overlong_penalty"], [0.0])
    ]
    assert groups[1][0].metric_names is None and [r.reward for r in groups[0]] == [1.0, 0.5]  # reward column kept
    assert shaped_rewards(groups, OverlongConfig(), 12) == ([[1.0, 0.5], [1.0]], 0)  # off by default
