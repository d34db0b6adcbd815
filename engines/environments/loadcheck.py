"""What loading a run (the CLI, `--dry-run` included) checks about its environments beyond the config.

Data flow: each `[[envs]]` entry -> `plugins.build` + `plugins.smoke` (engines/environments/plugins.py)
-> a bounded sample of its first-turn prompts (`PROMPT_SAMPLE`): an environment with `preview(n)` (verifiers':
its taskset's first n tasks, read lazily, never the whole taskset) gives their messages; any other draws n tasks
from seeded rngs -> each rendered through the chat template by the run's tokenizer (a task's images as their image
tokens, engines/environments/multimodal.py; images for a text-only model are a problem reported here)
-> `EnvFacts` (config/envs.py: the longest prompt in tokens, whether the warm-up has demonstrations, what the run
draws from). The rules joining those facts with other sections (model.max_seq_len, sft.steps) are the run
config's (`RunConfig.env_problems`); the CLI reports the facts and refuses with every problem at once.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from config.envs import EnvFacts, EnvSpec
from engines.environments import multimodal, plugins
from engines.environments.base import EnvironmentRefused
from engines.environments.episodes import is_multi_turn
from engines.models.tokenizer import Tokenizer
from engines.models.vision import ImageError
from engines.registry import PluginError

PROMPT_SAMPLE = 16  # first-turn prompts measured per environment: bounded, whatever the taskset's size


def first_prompts(env: Any, count: int) -> tuple[list[Any], str]:
    """`count` first-turn conversations of `env` (or the tasks they come from) and what its run draws tasks from."""
    preview = getattr(env, "preview", None)
    if callable(preview):
        return preview(count)
    try:
        tasks = [env.sample(random.Random(f"load-check/{i}")) for i in range(count)]
    except Exception as exc:
        raise PluginError(f"sample(rng) raised {type(exc).__name__}: {exc}") from None
    return tasks, f"{count} tasks drawn by sample(rng)"


def prompt_lengths(env: Any, tok: Tokenizer, count: int = PROMPT_SAMPLE) -> tuple[list[int], str]:
    """The token counts of `count` of `env`'s first-turn prompts through the run's chat template, a task's image
    placeholders expanded to its images' tokens (engines/environments/multimodal.py)."""
    drawn_from, drawn = first_prompts(env, count)
    spec = multimodal.vision_spec(tok)
    try:
        return [
            len(tok.render_messages(p) if isinstance(p, list) else multimodal.prompt_ids(tok, p, spec))
            for p in drawn_from
        ], drawn
    except (EnvironmentRefused, ImageError) as exc:
        raise PluginError(str(exc)) from None
    except Exception as exc:
        raise PluginError(
            f"rendering its prompt through the chat template raised {type(exc).__name__}: {exc}"
        ) from None


def has_demonstrations(env: Any) -> bool:
    """Whether the SFT warm-up has reference answers: a single-turn task's `answer`, a multi-turn environment's
    `demonstration`; an environment that runs its own episodes (`run_group`) has them only with `demonstration`."""
    if is_multi_turn(env):
        return True
    if callable(getattr(env, "run_group", None)):
        return callable(getattr(env, "demonstration", None))
    return True


def inspect(
    specs: Sequence[EnvSpec], sources: Sequence[str], default_style: str, tok: Tokenizer
) -> tuple[list[EnvFacts], list[str]]:
    """Every entry built, smoke-tested and measured: the facts of those that load, and one problem per entry
    that does not, naming its source (profile file or command line), index, name and id."""
    facts, problems = [], []
    for i, (spec, source) in enumerate(zip(specs, sources, strict=True)):
        where = f"{source}: envs[{i}] (name {spec.label!r}, id {spec.id!r})"
        try:
            env = plugins.build(spec, default_style)
            plugins.smoke(env)
            lengths, drawn = prompt_lengths(env, tok)
        except PluginError as exc:
            problems.append(f"{where}: {exc}")
            continue
        facts.append(EnvFacts(where, len(lengths), max(lengths), has_demonstrations(env), drawn))
    return facts, problems
