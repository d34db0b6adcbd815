"""Groups in flight across steps: the orchestrator's long-horizon mode (`orchestrator.max_inflight_groups`).

Each step tops the pool up to `size` groups, dispatching new ones numbered from 0 under that step's id
(`s<step>-g<i>`: task and seeds are a pure function of (run seed, dispatch step, group), as for every group),
then takes the first `batch` groups to finish, oldest dispatch first among those finished, in id order. Groups
still running carry over to the next step, with their episodes mid-turn: a long episode keeps sampling while
the trainer publishes newer policies, and its later turns are sampled by them. The staleness rule then
decides about it when it is taken (engines/orchestrator/admission.py); a finished group none of whose rows
the rule would keep is aged out (never committed, listed in the manifest's `aged_out`) and replaced by a new
group, so a step always commits `batch` groups.

What survives a kill: the step's manifest lists the groups it committed (`groups`), those it dispatched
(`dispatched`), those it aged out (`aged_out`) and those left running (`inflight`). A resumed orchestrator
re-dispatches the last committed step's `inflight` groups from their first turn (their turns were never
committed) under the same ids and seeds, so every dispatched group is committed once, aged out once or still in
flight at the end, never lost or repeated.
With `size == batch` (the default) every group is taken in the step that dispatched it, as without a pool.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from storage import rollouts
from storage.rollouts import RolloutRow

GROUP_ID = re.compile(r"^s(\d{6})-g(\d{4})$")
Start = Callable[[int, int], Awaitable[list[RolloutRow]]]
Usable = Callable[[list[RolloutRow]], bool]


class Taken(NamedTuple):
    groups: dict[str, list[RolloutRow]]  # by id
    aged_out: list[str]  # finished, but every row over the staleness bound: never committed
    dispatched: list[str]  # groups dispatched to replace those


def parse_group_id(gid: str) -> tuple[int, int]:
    """(dispatch step, group) of a group id as `rollouts.group_id` writes it."""
    m = GROUP_ID.match(gid)
    if m is None:
        raise ValueError(f"not a group id (s<step:06>-g<group:04>): {gid!r}")
    return int(m.group(1)), int(m.group(2))


class GroupPool:
    def __init__(self, start: Start, size: int, batch: int):
        if size < batch:
            raise ValueError(f"a pool of {size} groups cannot fill a batch of {batch}")
        self.start, self.size, self.batch = start, size, batch
        self.running: dict[str, asyncio.Task[list[RolloutRow]]] = {}  # by group id, in dispatch order
        self.numbered: dict[int, int] = {}  # per dispatch step, the groups numbered so far

    def dispatch(self, step: int, group: int) -> str:
        gid = rollouts.group_id(step, group)
        if gid in self.running:
            raise RuntimeError(f"group {gid} is already in flight")
        self.running[gid] = asyncio.ensure_future(self.start(step, group))
        return gid

    def restore(self, inflight: list[str]) -> None:
        """Re-dispatch the groups a committed manifest left in flight, from their first turn."""
        for gid in inflight:
            self.dispatch(*parse_group_id(gid))

    def top_up(self, step: int, taken: int = 0) -> list[str]:
        """Dispatch step `step`'s new groups, numbered on from those it dispatched already, until `size` are
        in flight or already taken by the step; their ids."""
        first = self.numbered.get(step, 0)
        self.numbered[step] = first + max(0, self.size - taken - len(self.running))
        return [self.dispatch(step, g) for g in range(first, self.numbered[step])]

    async def take(self, step: int, usable: Usable) -> Taken:
        """The first `batch` finished groups that `usable` accepts (oldest first among the finished), by id; a
        finished group it refuses (every row of it over the staleness bound) is aged out, and new groups of
        `step` replace it. A group that failed raises here. The others keep running."""
        taken: dict[str, list[RolloutRow]] = {}
        aged: list[str] = []
        dispatched: list[str] = []
        while len(taken) < self.batch:
            for gid in [gid for gid, t in self.running.items() if t.done()][: self.batch - len(taken)]:
                rows = self.running.pop(gid).result()  # a failed group raises its own error now
                if usable(rows):
                    taken[gid] = rows
                else:
                    aged.append(gid)
            if len(taken) < self.batch:  # replaces aged-out groups only: a taken one is not sampled again
                dispatched += self.top_up(step, len(taken))
                await asyncio.wait([t for t in self.running.values()], return_when=asyncio.FIRST_COMPLETED)
        return Taken({gid: taken[gid] for gid in sorted(taken)}, aged, dispatched)

    def inflight(self) -> list[str]:
        return list(self.running)

    async def cancel(self) -> None:
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        self.running.clear()
