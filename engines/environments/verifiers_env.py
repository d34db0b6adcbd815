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

Tasks are drawn from the taskset lazily (`TaskPool`): an infinite taskset (`Taskset.INFINITE`, e.g. verifiers'
TextArena games) is read only as far as the highest index drawn, within its first `max_tasks`; a finite one is
read whole (up to `max_tasks`) at the first draw, in the orchestrator. Loading (the CLI, `--dry-run`) reads only
its first tasks (`preview`), whose first-turn messages it measures (engines/environments/loadcheck.py), and refuses
an env whose interception or agent runtimes cannot run here (`serving_problems`) before any episode starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.environments.base import EnvironmentRefused, Task
from engines.environments.episodes import GroupSampler
from engines.registry import PluginError, import_object
from storage import rollouts
from storage.rollouts import RolloutRow

Parser = Callable[[str], list[tuple[str, str]]]  # reply text -> [(tool name, JSON arguments)]
MODEL = "rollflow"  # the model name verifiers sends; rollflow's server serves one policy
# The tasks an infinite taskset's run draws from (its first ones) unless `max_tasks` says otherwise: drawing reads
# the taskset up to the index drawn, so this bounds what a run reads of a taskset that never ends.
INFINITE_POOL = 1000
# Remote runtimes (verifiers' `is_local = False`) and what each needs; the default `AgentConfig()` runtime is prime's.
REMOTE_CREDENTIALS = {
    "prime": "`prime login` or $PRIME_API_KEY",
    "modal": "`modal token new` or $MODAL_TOKEN_ID/$MODAL_TOKEN_SECRET",
    "e2b": "$E2B_API_KEY",
}


@dataclass(frozen=True)
class VerifiersTask(Task):
    index: int = 0  # the task's position in the environment's taskset


class TaskPool:
    """The tasks a run draws from: the taskset's first `size` tasks, read from one iterator only as far as an
    index needs (never listed whole when infinite). `size`: `max_tasks`, else INFINITE_POOL for an infinite
    taskset, else all of a finite one (read at the first draw). The task at an index is the taskset's own
    n-th, so a draw is a pure function of the rng, as resuming needs."""

    def __init__(self, taskset: Any, max_tasks: int | None):
        self.infinite = not taskset.bounded
        self.max_tasks = max_tasks
        self._tasks: list[Any] = []
        self._source = iter(taskset)
        self._ended = False

    def _read(self, count: float) -> None:
        while len(self._tasks) < count and not self._ended:
            chunk = list(itertools.islice(self._source, 64 if math.isinf(count) else int(count) - len(self._tasks)))
            self._tasks += chunk
            self._ended = not chunk

    def head(self, count: int) -> list[Any]:
        """The first `count` tasks (fewer when the taskset has fewer), reading no further."""
        self._read(count)
        return self._tasks[:count]

    def __getitem__(self, index: int) -> Any:
        self._read(index + 1)
        return self._tasks[index]

    def size(self) -> int:
        """How many tasks a draw picks among."""
        if self.infinite:
            return self.max_tasks or INFINITE_POOL
        self._read(self.max_tasks or math.inf)  # finite: read (up to max_tasks) at the first draw
        return min(len(self._tasks), self.max_tasks or len(self._tasks))

    def draw(self, rng: random.Random) -> int:
        size = self.size()
        if size == 0:
            raise PluginError("the verifiers environment's taskset yields no tasks")
        index = rng.randrange(size)
        self._read(index + 1)
        if index >= len(self._tasks):
            raise PluginError(
                f"the taskset is marked infinite but ended after {len(self._tasks)} tasks; set args.max_tasks "
                f"<= {len(self._tasks)}"
            )
        return index

    def describe(self) -> str:
        """What a run draws from, for the load report."""
        if self.infinite:
            return f"an infinite taskset: the run draws from its first {self.max_tasks or INFINITE_POOL} tasks"
        return "a finite taskset: the run draws from " + (
            f"its first {self.max_tasks} tasks" if self.max_tasks else "all of its tasks"
        )


class VerifiersEnvironment:
    """A verifiers Env behind rollflow's environment interface (`sample`) plus `run_group`, which the
    orchestrator calls instead of its own sampling (a `GroupEnvironment`, engines/environments/episodes.py)."""

    def __init__(self, name: str, env: Any, tool_parser: Parser | None, record: str | None, max_tasks: int | None):
        self.name, self.env, self.tool_parser, self.record = name, env, tool_parser, record
        self.tasks = TaskPool(env.taskset, max_tasks)
        self._stack: contextlib.AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    def sample(self, rng: random.Random) -> Task:
        index = self.tasks.draw(rng)
        prompt = self.tasks[index].data.prompt
        text = prompt if isinstance(prompt, str) else str(prompt)
        return VerifiersTask(self.name, text, "", index=index)

    def preview(self, count: int) -> tuple[list[list[dict]], str]:
        """The first-turn messages (system prompt, prompt) of the taskset's first `count` tasks, and what the run
        draws from: what loading measures (engines/environments/loadcheck.py) without drawing a run's task."""
        first = self.tasks.head(count)
        if not first:
            raise PluginError("the verifiers environment's taskset yields no tasks")
        return [first_messages(t.data) for t in first], self.tasks.describe()

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
        self._check_room(group, task)
        slots = self.env.slots(self.tasks[task.index], group.group_size)

        def bind(k: int) -> Callable[[Any], None]:
            def on_trace(trace: Any) -> None:
                client.bind(trace.id, k, group_id, step, group_idx, run_id)

            return on_trace

        episodes = await asyncio.gather(
            *(self.env.run_slot(slot, self.ctx.model_context, on_trace=bind(k)) for k, slot in enumerate(slots))
        )
        return [self._row(client, run_id, step, group_id, k, task, ep) for k, ep in enumerate(episodes)]

    def _check_room(self, group: GroupSampler, task: VerifiersTask) -> None:
        """Refuse (no restart) a task whose first prompt leaves the model no token in model.max_seq_len: every
        episode of it would fail, and so would every retry of its step."""
        length = len(group.tok.render_messages(first_messages(self.tasks[task.index].data)))
        if length >= group.max_seq_len:
            raise EnvironmentRefused(
                f"{self.name}: task {task.index}'s first prompt takes {length} tokens, which leaves no room in "
                f"model.max_seq_len={group.max_seq_len} for the model's first turn: set model.max_seq_len above "
                f"{length} (plus orchestrator.max_new_tokens), or shorten the environment's prompts"
            )

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


def first_messages(data: Any) -> list[dict]:
    """A task's first model call as the chat template sees it: its system prompt, then its prompt (text or
    messages). Harnesses that fold the system prompt into the user turn send the same text."""
    from verifiers.v1.types import content_text

    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *({"role": m.role, "content": content_text(m.content)} for m in data.prompt or [])]


def serving_problems(made: Any) -> list[str]:
    """What in an Env's config cannot run under rollflow, each with its fix: rollflow serves every model call
    through one in-process interception server on loopback, so the env's interception must be that server and
    every agent (and tool server) must run on this machine; a remote sandbox needs credentials and a tunnel."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.interception import requires_tunnel
    from verifiers.v1.interception.server import InterceptionServerConfig
    from verifiers.v1.runtimes import runtime_is_local

    problems = []
    interception = made.config.interception
    if not isinstance(interception, InterceptionServerConfig):
        problems.append(
            f"interception is {type(interception).__name__} (verifiers' default is the elastic pool): rollflow runs "
            "one in-process interception server; set `interception = InterceptionServerConfig()` "
            "(verifiers.v1.interception.server) in the env's config"
        )
    for role, agent in agent_config_fields(made.config).items():
        kind = getattr(agent.runtime, "type", type(agent.runtime).__name__)
        if not runtime_is_local(agent.runtime):
            needs = REMOTE_CREDENTIALS.get(kind, "credentials")
            problems.append(
                f"agent {role!r} runs in the {kind!r} runtime (verifiers' default `AgentConfig()` is 'prime'), a "
                f"remote sandbox that needs {needs} and a tunnel back to this machine: rollflow runs agents here; "
                f"set `{role} = AgentConfig(runtime=SubprocessConfig())` (verifiers.v1.runtimes.subprocess) "
                "or a local container runtime"
            )
    task_type = type(made.taskset).task_type()
    if requires_tunnel(True, [s.config for s in task_type.toolsets(made.taskset.config.task)]):
        problems.append("a tool server of its tasks runs in a remote runtime: run it locally (or colocated)")
    return problems


def _make_env(env: str, env_args: dict) -> Any:
    """The `verifiers.v1.Env` the factory `env` returns; one PluginError naming `args.env` otherwise."""
    import verifiers.v1 as vf

    factory = import_object(env)  # its PluginError already says what could not be imported
    try:
        made = factory(**env_args)
    except Exception as exc:
        raise PluginError(f"args.env {env!r} raised {type(exc).__name__}: {exc} (env_args {env_args})") from None
    if not isinstance(made, vf.Env):
        raise PluginError(f"args.env {env!r} returned a {type(made).__name__}, not a verifiers.v1.Env")
    return made


def verifiers(
    env: str,
    env_args: dict | None = None,
    tool_parser: str | None = None,
    record: str | None = None,
    max_tasks: int | None = None,
) -> VerifiersEnvironment:
    """The `verifiers` plugin: `env` is the import path of a factory returning a `verifiers.v1.Env`
    (called with `env_args`); `tool_parser` the import path of `text -> [(tool name, JSON arguments)]` for
    models without a native tool-call format (None: replies never call tools); `record` a JSONL file that
    gets each model turn's prompt ids and the server's choice as received (an audit trail; None: off);
    `max_tasks` how many of the taskset's first tasks the run draws from (None: all of a finite taskset,
    INFINITE_POOL of an infinite one)."""
    if max_tasks is not None and (isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1):
        raise PluginError(f"args.max_tasks = {max_tasks!r}: need a positive integer (or leave it unset)")
    made = _make_env(env, env_args or {})
    problems = serving_problems(made)
    if problems:
        raise PluginError(f"args.env {env!r}: " + "; and ".join(problems))
    parser = import_object(tool_parser) if tool_parser else None
    if parser is not None and not callable(parser):
        raise PluginError(f"tool_parser {tool_parser} is not callable")
    name = f"verifiers:{env.partition(':')[0]}"
    return VerifiersEnvironment(name, made, parser, record, max_tasks)
