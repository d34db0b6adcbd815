"""The ground layer stays light: importing every module of the config package (found by walking it, so a
new module is covered) and the CLI's parser loads neither torch nor Prefect, so `--help`, validation and
`--dry-run` are instant. The import rules between the layers themselves are checked by `lint-imports`
(pyproject.toml) in `make lint`."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import config

HEAVY = ("torch", "prefect", "fsspec", "pyarrow", "mlflow", "transformers")


def _loaded_after(statement: str) -> list[str]:
    code = f"{statement}; import sys; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_config_package_imports_neither_torch_nor_prefect():
    modules = [m.name for m in pkgutil.iter_modules(config.__path__, "config.")]
    assert {"config.run", "config.loader", "config.vllm", "config.trainer_parallel"} <= set(modules)  # found them
    assert _loaded_after("; ".join(f"import {m}" for m in modules)) == []


def test_cli_module_imports_nothing_heavy_before_a_command_runs():
    assert _loaded_after("import rollflow.cli") == []
