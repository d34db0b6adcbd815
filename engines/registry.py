"""Extension points resolved by name: an environment, a model family or an inference backend named in a
profile -> the object its code defines.

Names come from config/registry.py (rollflow's own, and every installed package's entry points in the
point's group); an import path `module:attribute` (the attribute may be dotted) names an object directly.
Every failure is a PluginError that says what could not be imported or found and what would be valid.
"""

from __future__ import annotations

import importlib
from typing import Any

from config.registry import registered


class PluginError(ValueError):
    """An extension that cannot be loaded or built; the message says why and what would be valid."""


def import_object(path: str) -> Any:
    """The object a `module:attr.path` string names; PluginError saying what could not be imported or found."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PluginError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
        raise PluginError(
            f"cannot import module {module_name!r} ({exc}); install the package that provides it or put its "
            "directory on PYTHONPATH"
        ) from None
    except Exception as exc:  # a plugin module that fails at import: show its own error
        raise PluginError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            where = f"{module_name}:{'.'.join(parts[:i])}" if i else f"module {module_name!r}"
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise PluginError(
                f"{where} has no attribute {part!r}; callables there: {', '.join(public) or '(none)'}"
            ) from None
        obj = getattr(obj, part)
    return obj


def path_of(kind: str, name: str, group: str, builtin: dict[str, str]) -> str:
    """The `module:attribute` a registered name points at; PluginError listing the registered names."""
    names = registered(group, builtin)
    if name not in names:
        raise PluginError(
            f"no {kind} named {name!r} in entry-point group {group!r}; registered: {', '.join(sorted(names))}; "
            "or give an import path `module:attribute`"
        )
    return names[name]


def load(kind: str, name: str, group: str, builtin: dict[str, str]) -> Any:
    """The object a registered name (or an import path `module:attribute`) names."""
    return import_object(name if ":" in name else path_of(kind, name, group, builtin))
