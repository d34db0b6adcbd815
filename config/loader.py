"""Compose TOML profiles left to right, apply dotted CLI overrides, validate into `RunConfig`.

Every leaf value remembers where it came from (a file or the command line) so a validation error
names the key as the profile writes it (config/base.py: aliases, keys written flat), the source that set
it, and what would be valid.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, Tag, ValidationError

from config.base import field_named, flat_keys, profile_keys
from config.run import SEED_SPELLINGS, RunConfig
from config.trust import refuse_untrusted

Key = tuple[str, ...]


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the source and what is valid."""


def parse_value(text: str) -> Any:
    """A CLI value is a TOML literal when it parses as one (3e-4, true, [1, 2]), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(dst: dict, src: dict, source: str, sources: dict[Key, str], prefix: Key = ()) -> None:
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, source, sources, path)
            continue
        dst[key] = value
        for old in [k for k in sources if k[: len(path)] == path]:
            del sources[old]
        sources[path] = source


def read_profile(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"profile {p} not found (profiles are TOML files, e.g. profiles/tiny-cpu.toml)")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc


def compose(profiles: Sequence[str | Path], overrides: Sequence[tuple[str, str]]) -> tuple[dict, dict[Key, str]]:
    """Merge profiles then overrides into one dict, plus the source of every key that was set."""
    data: dict = {}
    sources: dict[Key, str] = {}
    for path in profiles:
        _merge(data, read_profile(path), str(path), sources)
    _apply_overrides(data, sources, overrides)
    return data, sources


def _apply_overrides(data: dict, sources: dict[Key, str], overrides: Sequence[tuple[str, str]]) -> None:
    for dotted, text in overrides:
        parts = tuple(p.replace("-", "_") for p in dotted.split("."))
        nested: Any = parse_value(text)
        for part in reversed(parts):
            nested = {part: nested}
        _merge(data, nested, f"command line (--{dotted})", sources)


def _source_of(loc: Key, sources: dict[Key, str]) -> str:
    for n in range(len(loc), 0, -1):
        if loc[:n] in sources:
            return sources[loc[:n]]
    return "defaults"


def _walk(loc: Key) -> tuple[Key, type[BaseModel] | None, list[str]]:
    """A validation error's location -> (the keys as the profile writes them, the model found there or
    None, the keys a profile may write in that model's table)."""
    model: type[BaseModel] | None = RunConfig
    keys, out, parts = profile_keys(RunConfig), [], list(loc)
    while parts:
        part = parts.pop(0)
        name = field_named(model, part) if model is not None else None
        if model is None or name is None:
            out.append(part)
            model = None
            continue
        above = flat_keys(model, name)
        if not (parts and parts[0] in above):  # a key written flat one table up: not in the profile's path
            out.append(part)
        ann = model.model_fields[name].annotation
        if get_origin(ann) is list and parts and parts[0].isdigit():  # envs.0 -> EnvSpec
            ann = get_args(ann)[0]
            out.append(parts.pop(0))
        if parts and (member := _tagged_member(ann, parts[0])) is not None:  # a variant's tag: not a profile key
            ann = member
            parts.pop(0)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        keys = profile_keys(model, above) if model is not None else []
    return tuple(out), model, keys


def _tagged_member(ann: Any, tag: str) -> Any:
    """The member of a tagged union (`trainer.loss`: one model per `type`) that pydantic's error location
    names by `tag`; None when `ann` is no such union or has no such tag."""
    if get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    for member in get_args(ann):
        if get_origin(member) is Annotated:
            base, *meta = get_args(member)
            if any(isinstance(m, Tag) and m.tag == tag for m in meta):
                return base
    return None


def _describe(err: Any, sources: dict[Key, str]) -> str:
    raw = tuple(str(p) for p in err["loc"])
    loc, model, _ = _walk(raw)
    dotted = ".".join(loc) or "(top level)"
    where = _source_of(loc, sources)
    if err["type"] == "value_error" and model is not None:
        # A model-level check (e.g. async_level vs max_off_policy_steps): its message names the keys and
        # values involved, which may come from several sources, so attribute it to none of them.
        return f"{dotted}: {err['msg']}"
    if err["type"] == "extra_forbidden":
        _, parent, keys = _walk(raw[:-1])
        valid = ", ".join(keys) if parent else "see docs/configuration.md"
        scope = ".".join(loc[:-1]) or "the top level"
        return f"{where}: unknown key '{dotted}'; valid keys under {scope}: {valid}"
    return f"{where}: {dotted}: {err['msg']} (got {err.get('input')!r})"


def validate(data: dict, sources: dict[Key, str]) -> RunConfig:
    for seed_key, key in SEED_SPELLINGS.items():  # RunConfig reads the seed's spelling as `key`
        section = data.get(seed_key[0])
        if isinstance(section, dict) and section.get(seed_key[1]) is not None:
            sources[key] = _source_of(seed_key, sources)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e, sources) for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def env_sources(cfg: RunConfig, sources: dict[Key, str]) -> list[str]:
    """Where each `[[envs]]` entry was set (a profile file, the command line, or defaults), for the
    run-level plugin check's messages."""
    return [_source_of(("envs", str(i)), sources) for i in range(len(cfg.envs))]


def load_with_sources(
    profiles: Sequence[str | Path], overrides: Sequence[tuple[str, str]] = ()
) -> tuple[RunConfig, list[str]]:
    """The validated config and where each `[[envs]]` entry came from."""
    data, sources = compose(profiles, overrides)
    cfg = validate(data, sources)
    return cfg, env_sources(cfg, sources)


def load_run_config(profiles: Sequence[str | Path], overrides: Sequence[tuple[str, str]] = ()) -> RunConfig:
    return load_with_sources(profiles, overrides)[0]


def stored_with_sources(
    stored: dict, source: str, overrides: Sequence[tuple[str, str]] = (), trust: bool = False
) -> tuple[RunConfig, list[str]]:
    """A run's stored config (`config/run.json`, read from `source`) with overrides on top: what
    `rollflow resume OUTPUT_DIR [--KEY VALUE ...]` runs with; and where each `[[envs]]` entry came from.
    Unless `trust`, a stored config that names code other than by a registered name is refused
    (config/trust.py): writing a run directory must not be enough to run code here."""
    data: dict = {}
    sources: dict[Key, str] = {}
    _merge(data, {k: v for k, v in stored.items() if k != "run_id"}, source, sources)
    _apply_overrides(data, sources, overrides)
    cfg = validate(data, sources)
    if not trust:
        try:
            refuse_untrusted(cfg, source, overrides)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return cfg, env_sources(cfg, sources)


def load_stored_config(
    stored: dict, source: str, overrides: Sequence[tuple[str, str]] = (), trust: bool = False
) -> RunConfig:
    return stored_with_sources(stored, source, overrides, trust)[0]
