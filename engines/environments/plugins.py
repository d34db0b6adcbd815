"""Environment plugins: an `[[envs]]` entry's `id` -> its factory -> an Environment.

An id is an import path (`module:attribute`, the attribute may be dotted) or a name in the
`rollflow.envs` entry-point group (config/registry.py; rollflow's own toy tasks and reasoning-gym are
registered there, pyproject.toml). The factory is called with the entry's `args` as keyword arguments,
plus `prompt_style` when it takes one. `check` runs the whole chain once at load, in the CLI process, and
reports every problem with the env, the profile that set it and what would be valid; the orchestrator
and the warm-up then build the same environments with `build`.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

from config.envs import EnvSpec, is_import_path
from config.registry import ENV_GROUP, ENVIRONMENTS
from engines import registry
from engines.registry import PluginError


def resolve(env_id: str) -> Callable[..., Any]:
    """The factory an id names (imports its module)."""
    target = env_id if is_import_path(env_id) else registry.path_of("environment", env_id, ENV_GROUP, ENVIRONMENTS)
    factory = registry.import_object(target)
    if not callable(factory):
        raise PluginError(f"{target} is a {type(factory).__name__}, not a callable factory of an Environment")
    return factory


def _parameters(factory: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: call them and see
        return None


def _takes(sig: inspect.Signature | None, name: str) -> bool:
    if sig is None:
        return False
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def _bind_args(factory: Callable[..., Any], spec: EnvSpec, style: str) -> dict[str, Any]:
    sig = _parameters(factory)
    kwargs = dict(spec.args)
    if _takes(sig, "prompt_style"):
        kwargs.setdefault("prompt_style", style)
    elif spec.prompt != "auto":
        raise PluginError(f"prompt = {spec.prompt!r} is set but the factory takes no `prompt_style`; remove it")
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as exc:
            accepted = [n for n, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
            raise PluginError(
                f"bad args {spec.args}: {exc}; the factory accepts: {', '.join(accepted) or '(no arguments)'}"
            ) from None
    return kwargs


def make(spec: EnvSpec, default_style: str = "tag") -> Any:
    """What the entry's factory returns for its args, unchecked; `default_style` replaces
    `prompt = "auto"` (the tokenizer's `prompt_style`)."""
    factory = resolve(spec.id)
    kwargs = _bind_args(factory, spec, default_style if spec.prompt == "auto" else spec.prompt)
    try:
        return factory(**kwargs)
    except PluginError:
        raise  # a factory that loads plugins itself (verifiers) already says what failed: one layer of wrapping
    except Exception as exc:
        raise PluginError(f"the factory raised {type(exc).__name__}: {exc} (args {spec.args})") from None


def build(spec: EnvSpec, default_style: str = "tag") -> Any:
    """The single-turn Environment an `[[envs]]` entry describes (`make`, then the protocol check)."""
    env = make(spec, default_style)
    # an environment that runs its own episodes (`run_group`, e.g. verifiers') scores them itself
    needed = ("sample",) if callable(getattr(env, "run_group", None)) else ("sample", "reward")
    missing = [m for m in needed if not callable(getattr(env, m, None))]
    if missing:
        raise PluginError(
            f"the factory returned a {type(env).__name__}, which is not an Environment: it lacks "
            f"{' and '.join(missing)}() (an Environment has sample(rng) -> Task and reward(task, completion) -> float)"
        )
    return env


def smoke(env: Any) -> None:
    """One task drawn and scored, so an environment that breaks on use fails at load too. An environment with
    `preview(n)` (verifiers': its taskset's first tasks, read lazily) is read through it instead, so loading
    never draws from an unbounded pool."""
    task: Any
    if callable(getattr(env, "preview", None)):
        try:
            env.preview(1)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"reading its first task raised {type(exc).__name__}: {exc}") from None
        return
    try:
        task = env.sample(random.Random(0))
    except Exception as exc:
        raise PluginError(f"sample(rng) raised {type(exc).__name__}: {exc}") from None
    is_task = dataclasses.is_dataclass(task) and not isinstance(task, type)
    if not is_task or not all(isinstance(getattr(task, f, None), str) for f in ("env", "prompt", "answer")):
        raise PluginError(f"sample(rng) returned {task!r}, not a Task (a dataclass with env, prompt, answer strings)")
    if callable(getattr(env, "run_group", None)):
        return
    try:
        reward = env.reward(task, task.answer)
    except Exception as exc:
        raise PluginError(f"reward(task, completion) raised {type(exc).__name__}: {exc}") from None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise PluginError(f"reward(task, completion) returned {reward!r}, not a float")


def check(specs: Sequence[EnvSpec], sources: Sequence[str], default_style: str) -> None:
    """Build every environment and draw one task from each; one PluginError listing every problem, each
    naming the env, its index, its id and the source (profile file or command line) that set it."""
    problems = []
    for i, (spec, source) in enumerate(zip(specs, sources, strict=True)):
        try:
            smoke(build(spec, default_style))
        except PluginError as exc:
            problems.append(f"{source}: envs[{i}] (name {spec.label!r}, id {spec.id!r}): {exc}")
    if problems:
        raise PluginError("invalid environment:\n  " + "\n  ".join(problems))
