"""Multi-turn episodes: several model turns with environment or tool responses between them.

A `MultiTurnEnvironment` samples a task like any environment, answers each model reply with messages
(a tool result, a follow-up question) or ends the episode, and scores the whole episode. The episode is
built in token ids, never re-tokenized text: each turn's prompt is the previous context's ids (the first
prompt, then every sampled token exactly as the server returned it) plus the environment's messages
rendered through the chat template (`Tokenizer.render_continuation`). What the lake stores per episode
(`storage.rollouts.RolloutRow`): the first prompt as `prompt_ids`, everything after it as
`completion_ids`, `completion_mask` 1 on sampled tokens and 0 on environment tokens, the server's
logprobs on sampled tokens (0 elsewhere), and each model turn's policy versions. Every request of an
episode carries the same session id (engines/orchestrator/multiturn.py), so a replica router keeps the
episode on one KV cache.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engines.environments.base import EnvironmentRefused, Task
from engines.models.tokenizer import Tokenizer
from engines.protocol import CompletionChoice, CompletionRequest
from storage.rollouts import RolloutRow


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An environment whose episodes have several model turns (at most `max_turns`)."""

    name: str
    max_turns: int

    def sample(self, rng: random.Random) -> Task: ...

    def respond(self, task: Task, replies: list[str]) -> list[dict] | None:
        """Messages ({"role", "content"}) answering the model's latest reply, or None to end the episode."""
        ...

    def score(self, task: Task, replies: list[str]) -> float:
        """The episode's reward from the model's replies (decoded text of each turn)."""
        ...

    def demonstration(self, task: Task) -> list[str]:
        """Reference replies of a good episode, for the supervised warm-up."""
        ...


def is_multi_turn(env: object) -> bool:
    return isinstance(env, MultiTurnEnvironment)


@dataclass
class Episode:
    """One finished episode, in the lake's terms (see the module docstring)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    # per completion token, the sampler's kept support size (0 on environment tokens and on turns that did
    # not return one); stored only when some turn returned them (top-p / top-k truncation)
    completion_kept: list[int] = field(default_factory=list)
    kept_returned: bool = False
    replies: list[str] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_versions_end: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    text: str = ""  # the whole completion, decoded with special tokens (for reading shards)

    def row(self, task: Task, run_id: str, step: int, sample_id: str, group_id: str, **scored) -> RolloutRow:
        """The episode's lake row; `scored`: reward, temperature and any other RolloutRow field (the
        orchestrator sets the advantage)."""
        return RolloutRow(
            run_id=run_id,
            step=step,
            sample_id=sample_id,
            group_id=group_id,
            env=task.env,
            policy_version=min(self.turn_versions),
            policy_version_end=max(self.turn_versions_end),
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            completion_logprobs=self.completion_logprobs,
            finish_reason=self.finish_reason,
            prompt_text=task.prompt,
            completion_text=self.text,
            completion_mask=self.completion_mask,
            completion_kept=self.completion_kept if self.kept_returned else None,
            turn_policy_versions=self.turn_versions,
            turn_policy_versions_end=self.turn_versions_end,
            **scored,
        )

    def add_turn(self, choice: CompletionChoice) -> None:
        if choice.token_ids is None or choice.logprobs is None:
            raise RuntimeError("inference response lacks token_ids or logprobs, which the request asked for")
        ids, lps = choice.token_ids, choice.logprobs.token_logprobs
        if len(ids) != len(lps):
            raise RuntimeError(f"inference returned {len(ids)} token ids but {len(lps)} logprobs")
        self.completion_ids += ids
        self.completion_logprobs += lps
        self.completion_mask += [1] * len(ids)
        kept = choice.kept_sizes
        if kept is not None and len(kept) != len(ids):
            raise RuntimeError(f"inference returned {len(ids)} token ids but {len(kept)} kept sizes")
        self.completion_kept += kept if kept is not None else [0] * len(ids)
        self.kept_returned |= kept is not None
        self.replies.append(choice.text)
        self.turn_versions.append(choice.policy_version)
        self.turn_versions_end.append(choice.policy_version_end)
        self.finish_reason = choice.finish_reason

    def add_environment(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.completion_logprobs += [0.0] * len(ids)
        self.completion_mask += [0] * len(ids)
        self.completion_kept += [0] * len(ids)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


# (request, session id) -> the one sampled choice; the orchestrator posts it to the inference server
Sampler = Callable[[CompletionRequest, str], Awaitable[CompletionChoice]]
# (context ids, room for new tokens, turn) -> that turn's request (sampling settings and seed)
RequestBuilder = Callable[[list[int], int, int], CompletionRequest]


class GroupSampler(Protocol):
    """What an environment that runs a group's episodes itself samples through: the orchestrator's group
    (engines/orchestrator/multiturn.py's `EpisodeGroup`), `group_size` episodes of one task."""

    tok: Tokenizer
    group_size: int
    temperature: float
    max_seq_len: int

    def request(self, step: int, group: int, k: int) -> RequestBuilder:
        """Episode `k`'s request builder: its seeds are a pure function of (run seed, step, group, k, turn)."""
        ...

    async def sample(self, request: CompletionRequest, session_id: str) -> CompletionChoice: ...


@runtime_checkable
class GroupEnvironment(Protocol):
    """An environment that runs a group's episodes itself (verifiers environments). It returns the group's
    rows scored (reward, metrics); the orchestrator sets their advantages, as for every environment."""

    name: str

    def sample(self, rng: random.Random) -> Task: ...

    async def run_group(
        self, sampler: GroupSampler, task: Task, run_id: str, step: int, group: int
    ) -> list[RolloutRow]: ...


async def run_episode(
    env: MultiTurnEnvironment,
    task: Task,
    tok: Tokenizer,
    sample: Sampler,
    request: RequestBuilder,
    session_id: str,
    max_seq_len: int,
) -> Episode:
    """Alternate model turns and environment responses until the environment ends the episode, a turn
    stops on length, `max_turns` is reached, or the context has no room for another turn.

    `request(context_ids, max_tokens, turn)` builds each turn's request (sampling settings and seed).
    """
    episode = Episode(prompt_ids=tok.render_prompt(task.prompt))
    if len(episode.prompt_ids) >= max_seq_len:  # every episode of the task, and every retry, would fail
        raise EnvironmentRefused(
            f"{env.name}: a first prompt takes {len(episode.prompt_ids)} tokens, which leaves no room in "
            f"model.max_seq_len={max_seq_len} for the model's first turn: set model.max_seq_len above "
            f"{len(episode.prompt_ids)} (plus orchestrator.max_new_tokens), or shorten the environment's prompts"
        )
    for turn in range(env.max_turns):
        room = max_seq_len - len(episode.context)
        choice = await sample(request(episode.context, room, turn), session_id)
        episode.add_turn(choice)
        if choice.finish_reason != "stop":
            break
        messages = env.respond(task, episode.replies)
        if messages is None or turn + 1 == env.max_turns:
            break
        response = tok.render_continuation(messages)
        if len(episode.context) + len(response) >= max_seq_len:  # no room for a model token after it
            break
        episode.add_environment(response)
    episode.text = tok.decode(episode.completion_ids, skip_special=False)
    return episode


def demonstration_ids(env: MultiTurnEnvironment, task: Task, tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(ids, mask over ids) of the environment's reference episode: mask 1 on the reply tokens and their
    end-of-sequence, as the warm-up trains them; environment tokens are rendered as in `run_episode`."""
    ids = tok.render_prompt(task.prompt)
    mask = [0] * len(ids)
    replies: list[str] = []
    for reply in env.demonstration(task):
        turn = tok.encode(reply, bos=False) + [tok.eos_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        replies.append(reply)
        messages = env.respond(task, replies)
        if messages is None or len(replies) == len(env.demonstration(task)):
            break
        response = tok.render_continuation(messages)
        ids, mask = ids + response, mask + [0] * len(response)
    return ids, mask
