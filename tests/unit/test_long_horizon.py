"""Long-horizon episodes: the `long-hop` environment, the staleness rule for episodes
(engines/orchestrator/admission.py) and the pool that keeps groups in flight across steps
(engines/orchestrator/pool.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from config.orchestrator import OrchestratorConfig
from engines.environments.episodes import demonstration_ids, is_multi_turn
from engines.environments.longhop import long_hop
from engines.models.tokenizer import CharTokenizer
from engines.orchestrator.admission import admit, turn_spans
from engines.orchestrator.pool import GroupPool, parse_group_id
from storage import rollouts
from storage.rollouts import RolloutRow

TOK = CharTokenizer()


def test_long_hop_chains_tool_calls_for_every_turn_and_scores_each_call():
    env = long_hop(turns=20)
    assert is_multi_turn(env) and env.max_turns == 20
    task = env.sample(random.Random(4))
    demo = env.demonstration(task)
    assert len(demo) == 20 and all(r.startswith("?") for r in demo) and env.score(task, demo) == 1.0
    (msg,) = env.respond(task, demo[:1]) or []
    assert msg["content"] == ":" + demo[1][1:]  # the tool's answer is the next key to call
    assert env.respond(task, demo) is None  # the episode ends after `turns` calls
    wrong = ["?zz", *demo[1:]]  # a wrong first call: the chain goes on from the wrong key's answer
    assert env.respond(task, wrong[:1]) != env.respond(task, demo[:1])
    # turn 0 scores 0, turn 1 is judged against the wrong key's answer, turns 2.. are right again
    assert 18 / 20 <= env.score(task, wrong) <= 19 / 20
    assert 18 / 20 <= env.score(task, ["no call", *demo[1:]]) <= 19 / 20  # not a call: 0 for that turn
    assert env.score(task, demo[:10]) == 0.5  # turns not reached count as 0
    ids, mask = demonstration_ids(env, task, TOK)
    assert len(ids) <= 192 and len(turn_spans(mask[len(TOK.render_prompt(task.prompt)) :])) == 20
    for bad in ({"turns": 0}, {"min_chars": 3, "max_chars": 2}, {"alphabet": "aB"}):
        with pytest.raises(ValueError, match="turns|min_chars|alphabet"):
            long_hop(**bad)  # type: ignore[arg-type]
    small = long_hop(alphabet="ab")
    assert set(small.sample(random.Random(5)).prompt.removeprefix("hop:")) <= {"a", "b"}


def _row(versions: list[int], step: int = 4, sid: str = "s000001-g0000-00") -> RolloutRow:
    """An episode of len(versions) model turns of 2 tokens, with a 1-token tool answer between them."""
    ids, mask, lps = [], [], []
    for t in range(len(versions)):
        if t:
            ids, mask, lps = ids + [9], mask + [0], lps + [0.0]
        ids, mask, lps = ids + [10, 2], mask + [1, 1], lps + [-0.5, -0.1]
    return RolloutRow(
        run_id="r", step=step, sample_id=sid, group_id=sid[:13], env="long-hop",
        policy_version=min(versions), policy_version_end=max(versions), prompt_ids=[1, 20], completion_ids=ids,
        completion_logprobs=lps, reward=0.5, advantage=1.0, temperature=1.0, finish_reason="stop",
        prompt_text="hop:ab", completion_text="", completion_mask=mask,
        turn_policy_versions=versions, turn_policy_versions_end=versions,
    )  # fmt: skip


def test_staleness_rule_masks_the_turns_that_outlived_the_bound():
    # step 4 trains on version 3; bound 1: turns of versions 0 and 1 are stale (ages 3, 2), versions 2, 3 are not
    fresh, long, dead = _row([2, 3]), _row([0, 1, 2, 3]), _row([0, 1])
    kept, done = admit([fresh, long, dead], 4, 1, "mask")
    assert kept[0] == fresh and len(kept) == 2  # a row within the bound is untouched; `dead` has no fresh turn
    assert kept[1].completion_mask == [0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1]
    assert kept[1].completion_logprobs == long.completion_logprobs  # masked turns keep what the sampler said
    assert kept[1].policy_version == 2 and kept[1].turn_policy_versions == [0, 1, 2, 3]
    assert all(rollouts.staleness(4, v) <= 1 for v in [kept[1].policy_version])
    assert (done.dropped, done.masked_rows, done.masked_turns, done.masked_tokens) == (1, 1, 2, 4)
    assert done.meta() == {"dropped": 1, "masked_rows": 1, "masked_turns": 2, "masked_tokens": 4}
    rollouts.to_table(kept)  # still a valid lake row (ends on a model token)


def test_staleness_rule_drop_mode_and_rows_it_cannot_mask_drop_whole():
    long = _row([0, 1, 2, 3])
    kept, done = admit([_row([2, 3]), long], 4, 1, "drop")
    assert len(kept) == 1 and done.meta() == {"dropped": 1}
    merged = long.model_copy(update={"completion_mask": [1] * len(long.completion_ids)})  # turns cannot be told apart
    single = long.model_copy(update={"completion_mask": None, "turn_policy_versions": None})
    assert admit([merged, single], 4, 1, "mask")[1].dropped == 2
    assert admit([long], 4, 3, "mask")[0] == [long]  # within a looser bound: kept whole


def _pool(finish: dict[tuple[int, int], asyncio.Event], size: int = 3, batch: int = 2) -> GroupPool:
    async def start(step: int, group: int) -> list[RolloutRow]:
        await finish.setdefault((step, group), asyncio.Event()).wait()
        if (step, group) == (9, 9):
            raise RuntimeError("the group's episode failed")
        return [_row([step], step, rollouts.sample_id(rollouts.group_id(step, group), 0))]

    return GroupPool(start, size, batch)


def _ok(rows: list[RolloutRow]) -> bool:
    return True


def test_pool_takes_the_first_groups_to_finish_and_carries_the_rest():
    async def scenario() -> None:
        finish: dict[tuple[int, int], asyncio.Event] = {}
        pool = _pool(finish)
        assert pool.top_up(1) == ["s000001-g0000", "s000001-g0001", "s000001-g0002"]
        await asyncio.sleep(0)
        finish[(1, 2)].set()
        finish[(1, 0)].set()
        taken = await pool.take(1, _ok)
        assert list(taken.groups) == ["s000001-g0000", "s000001-g0002"] and pool.inflight() == ["s000001-g0001"]
        assert taken.aged_out == taken.dispatched == []
        assert pool.top_up(2) == ["s000002-g0000", "s000002-g0001"]  # back to 3 in flight
        await asyncio.sleep(0)
        for key in [(1, 1), (2, 0), (2, 1)]:
            finish[key].set()
        await asyncio.sleep(0)
        assert list((await pool.take(2, _ok)).groups) == ["s000001-g0001", "s000002-g0000"]  # oldest first
        await pool.cancel()
        assert pool.inflight() == []
        resumed = _pool(finish)  # a resume re-dispatches what a manifest left in flight, under the same ids
        resumed.restore(["s000002-g0001"])
        assert resumed.top_up(3) == ["s000003-g0000", "s000003-g0001"]
        await resumed.cancel()

    asyncio.run(scenario())


def test_a_pool_of_one_batch_samples_each_step_only_for_that_step():
    """Without carry-over (size == batch) a step dispatches exactly its batch and leaves nothing running: a group
    taken is not replaced, so no group of the next step is sampled with this step's policy (async_level 0 stays
    on-policy)."""

    async def scenario() -> None:
        finish: dict[tuple[int, int], asyncio.Event] = {}
        pool = _pool(finish, size=2, batch=2)
        assert pool.top_up(1) == ["s000001-g0000", "s000001-g0001"]
        await asyncio.sleep(0)
        finish[(1, 0)].set()
        take = asyncio.ensure_future(pool.take(1, _ok))
        await asyncio.sleep(0.05)
        assert not take.done() and pool.inflight() == ["s000001-g0001"]  # the taken group was not replaced
        finish[(1, 1)].set()
        taken = await asyncio.wait_for(take, 5)
        assert list(taken.groups) == ["s000001-g0000", "s000001-g0001"] and taken.dispatched == []
        assert pool.inflight() == []
        await pool.cancel()

    asyncio.run(scenario())


def test_pool_ages_out_groups_the_rule_would_drop_whole_and_replaces_them():
    async def scenario() -> None:
        finish: dict[tuple[int, int], asyncio.Event] = {}
        pool = _pool(finish)
        pool.top_up(1)
        await asyncio.sleep(0)
        for key in [(1, 0), (1, 1)]:
            finish[key].set()
        fresh = asyncio.ensure_future(pool.take(3, lambda rows: rows[0].step == 3))  # only step-3 groups usable
        await asyncio.sleep(0.05)
        assert not fresh.done() and pool.inflight() == ["s000001-g0002", "s000003-g0000", "s000003-g0001"]
        for key in [(3, 0), (3, 1)]:
            finish[key].set()
        taken = await asyncio.wait_for(fresh, 5)
        assert list(taken.groups) == ["s000003-g0000", "s000003-g0001"]
        assert taken.aged_out == ["s000001-g0000", "s000001-g0001"]
        assert taken.dispatched == ["s000003-g0000", "s000003-g0001"]
        assert pool.top_up(3) == ["s000003-g0002", "s000003-g0003"]  # numbered on
        await pool.cancel()
        failing = _pool(finish, size=2, batch=2)
        failing.dispatch(9, 9)
        failing.dispatch(9, 8)
        await asyncio.sleep(0)
        finish[(9, 9)].set()
        with pytest.raises(RuntimeError, match="episode failed"):  # raised at once, not after the others
            await asyncio.wait_for(failing.take(9, _ok), 5)
        await failing.cancel()

    asyncio.run(scenario())
    assert parse_group_id("s000012-g0003") == (12, 3)
    with pytest.raises(ValueError, match="not a group id"):
        parse_group_id("s12-g3")
    with pytest.raises(ValueError, match="cannot fill a batch"):
        GroupPool(lambda s, g: None, 1, 2)  # type: ignore[arg-type, return-value]


def test_config_refuses_a_pool_smaller_than_a_batch():
    assert OrchestratorConfig(batch_size=4).inflight_groups == 4
    assert OrchestratorConfig(batch_size=4, max_inflight_groups=6).inflight_groups == 6
    with pytest.raises(ValidationError, match="max_inflight_groups=3 is less than orchestrator.batch_size=4"):
        OrchestratorConfig(batch_size=4, max_inflight_groups=3)
    with pytest.raises(ValidationError, match="stale_turns"):
        OrchestratorConfig(stale_turns="keep")
