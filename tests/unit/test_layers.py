"""The ground layer stays light: importing the config package (and the CLI's parser) loads neither torch
nor Prefect, so `--help`, validation and `--dry-run` are instant. The import rules between the layers
themselves are checked by `lint-imports` (pyproject.toml) in `make lint`."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "prefect", "fsspec", "pyarrow", "mlflow", "transformers")


def _loaded_after(statement: str) -> list[str]:
    code = f"{statement}; import sys; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_config_package_imports_neither_torch_nor_prefect():
    mods = "base envs inference loader model orchestrator process redact resume run storage tracking trainer"
    stmt = "; ".join(f"import config.{m}" for m in mods.split())
    assert _loaded_after(stmt) == []


def test_cli_module_imports_nothing_heavy_before_a_command_runs():
    assert _loaded_after("import rollflow.cli") == []
