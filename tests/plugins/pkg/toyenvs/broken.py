"""A plugin module that fails while being imported (a dependency it lacks)."""

import toyenvs_missing_dependency  # noqa: F401
