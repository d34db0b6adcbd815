"""Resolve config/registry.py's entries (`module:attribute` import paths) to the objects they name."""

from __future__ import annotations

import importlib
from typing import Any


def load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
