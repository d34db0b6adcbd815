"""verifiers (v1) environments as rollflow environments: `[[envs]] id = "verifiers"`,
`args = {env = "pkg.mod:load_environment", env_args = {...}, tool_parser = "pkg.mod:parse", record = PATH}`.

The factory named by `env` returns a `verifiers.v1.Env` (taskset + harness + rubric). Each group runs
`group_size` of its episodes on one task through verifiers' own machinery (`Env.serving()`, its
interception server, `Env.run_slot`) inside the orchestrator process. Every model call the harness makes
reaches `TokenClient`, a verifiers `Client` that never renders text: the first turn's prompt is the chat
template over the task's messages, each later turn's prompt is the episode's ids so far (every sampled token
exactly as rollflow's server returned it) plus the new tool/user messages rendered by
`Tokenizer.render_continuation`, and the server samples from those ids (`/v1/completions`, `return_token_ids`,
logprobs). So each episode is an `engines.environments.episodes.Episode` built turn by turn from the server's responses:
`completion_mask` 1 on sampled tokens, 0 on tool/user tokens, the server's logprobs, each turn's policy
versions. The client also hands verifiers the turn's ids (`Response.tokens`) so its trace records them.
Rewards are the rubric's (`Trace.reward`, its weighted `@reward`s); its rewards and `@metric`s by name go
into the row's `metric_names`/`metric_values`, which the trainer averages into metrics.jsonl. `run_group`
returns the group's rows scored; the orchestrator sets their advantages, as for every environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.environments.base import Task
from engines.environments.episodes import GroupSampler
from engines.registry import PluginError, import_object
from storage import rollouts
from storage.rollouts import RolloutRow

Parser = Callable[[str], list[tuple[str, str]]]  # reply text -> [(tool name, JSON arguments)]
MODEL = "rollflow"  # the model name verifiers sends; rollflow's server serves one policy


@dataclass(frozen=True)
class VerifiersTask(Task):
    index: int = 0  # the task's position in the environment's taskset


class VerifiersEnvironment:
    """A verifiers Env behind rollflow's environment interface (`sample`) plus `run_group`, which the
    orchestrator calls instead of its own sampling (a `GroupEnvironment`, engines/environments/episodes.py)."""

    def __init__(self, name: str, env: Any, tool_parser: Parser | None, record: str | None):
        self.name, self.env, self.tool_parser, self.record = name, env, tool_parser, record
        self.tasks = list(env.taskset)
        if not self.tasks:
            raise PluginError("the verifiers environment's taskset yields no tasks")
        self._stack: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    def sample(self, rng: random.Random) -> Task:
        index = rng.randrange(len(self.tasks))
        prompt = self.tasks[index].data.prompt
        text = prompt if isinstance(prompt, str) else str(prompt)
        return VerifiersTask(self.name, text, "", index=index)

    async def _serving(self, client: Any) -> None:
        """verifiers' serving resources (interception server, shared tools) for this process's lifetime,
        with `client` as the model client of every rollout."""
        from engines.environments.verifiers_client import install_client

        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.env.serving())
        self.ctx = install_client(self.env, client, MODEL)
        self._stack = stack

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    async def run_group(
        self, group: GroupSampler, task: Task, run_id: str, step: int, group_idx: int
    ) -> list[RolloutRow]:
        """The group's `group_size` episodes of `task`, one scored row each (reward and the rubric's scores)."""
        from engines.environments.verifiers_client import TokenClient

        async with self._starting:  # a step's groups start together: one of them brings the env up
            if self._stack is None:
                await self._serving(TokenClient(group, self.tool_parser, self.record))
        client: TokenClient = self.ctx.client_object
        assert isinstance(task, VerifiersTask)
        group_id = rollouts.group_id(step, group_idx)
        slots = self.env.slots(self.tasks[task.index], group.group_size)

        def bind(k: int) -> Callable[[Any], None]:
            def on_trace(trace: Any) -> None:
                client.bind(trace.id, k, group_id, step, group_idx, run_id)

            return on_trace

        episodes = await asyncio.gather(
            *(self.env.run_slot(slot, self.ctx.model_context, on_trace=bind(k)) for k, slot in enumerate(slots))
        )
        return [self._row(client, run_id, step, group_id, k, task, ep) for k, ep in enumerate(episodes)]

    def _row(self, client: Any, run_id: str, step: int, group_id: str, k: int, task: Task, ep: Any) -> RolloutRow:
        sample_id = rollouts.sample_id(group_id, k)
        if ep.errors or len(ep.traces) != 1:
            raise RuntimeError(f"verifiers episode {sample_id} failed: {[str(e) for e in ep.errors]}")
        (trace,) = ep.traces
        if trace.errors:
            raise RuntimeError(f"verifiers episode {sample_id} failed: {[str(x) for x in trace.errors]}")
        e = client.finish(trace.id)
        scores = {f"reward/{n}": r.value for n, r in trace.rewards.items() if r is not None}
        scores |= {f"metric/{n}": float(v) for n, v in trace.metrics.items() if v is not None}
        return e.row(
            task,
            run_id,
            step,
            sample_id,
            group_id,
            reward=float(trace.reward),
            temperature=client.temperature,
            metric_names=list(scores) or None,
            metric_values=list(scores.values()) or None,
        )


def verifiers(
    env: str, env_args: dict | None = None, tool_parser: str | None = None, record: str | None = None
) -> VerifiersEnvironment:
    """The `verifiers` plugin: `env` is the import path of a factory returning a `verifiers.v1.Env`
    (called with `env_args`); `tool_parser` the import path of `text -> [(tool name, JSON arguments)]` for
    models without a native tool-call format (None: replies never call tools); `record` a JSONL file that
    gets each model turn's prompt ids and the server's choice as received (an audit trail; None: off)."""
    import verifiers.v1 as vf

    factory = import_object(env)
    made = factory(**(env_args or {}))
    if not isinstance(made, vf.Env):
        raise PluginError(f"{env} returned a {type(made).__name__}, not a verifiers.v1.Env")
    parser = import_object(tool_parser) if tool_parser else None
    if parser is not None and not callable(parser):
        raise PluginError(f"tool_parser {tool_parser} is not callable")
    name = f"verifiers:{env.partition(':')[0]}"
    return VerifiersEnvironment(name, made, parser, record)
