"""What a run config read back from a run directory may name: code only by a name registered on this host.

A profile is code: it names the environments, estimators and losses to import and the interpreter, process
environment and shell lines to run. `config/run.json` keeps the whole config in the run directory, and writing a
run directory must not be enough to run code on the host that resumes it (`rollflow resume`, the scheduled
`resume-unfinished` flow). So a config read from there may name code only by a registered name (config/registry.py:
rollflow's own and the entry points of packages installed on this host); refused, with the keys named, unless the
user vouches for it (`rollflow resume --trust-run-config`, the flow's `trust_run_config`) or sets that key again
on the command line:

- an import path `module:attribute` anywhere in it (an `[[envs]] id`, an advantage or loss `type`, a verifiers
  environment's `args.env` ...) that is no registered entry's own target;
- a setting that runs what it names (`RUNS_WHAT_IT_NAMES`) at other than its default.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel

from config import registry

# (model class, field): settings that execute what they name
RUNS_WHAT_IT_NAMES = {
    ("VLLMConfig", "python"): "the interpreter started for vLLM",
    ("VLLMConfig", "env"): "environment variables of the vLLM processes (LD_PRELOAD, PYTHONPATH ...)",
    ("VLLMConfig", "vllm_extra"): "vLLM command-line flags (--worker-extension-cls imports a class)",
    ("DisaggregatedDeployment", "prefill_env_overrides"): "environment variables of the prefill servers",
    ("DisaggregatedDeployment", "decode_env_overrides"): "environment variables of the decode servers",
    ("SlurmJobConfig", "setup"): "shell lines the batch script runs",
    ("SlurmJobConfig", "extra_sbatch"): "#SBATCH lines",
    ("SlurmJobConfig", "srun_args"): "srun arguments",
}
GROUPS = (
    (registry.ENV_GROUP, registry.ENVIRONMENTS),
    (registry.ADVANTAGE_GROUP, registry.ADVANTAGES),
    (registry.LOSS_GROUP, registry.LOSSES),
    (registry.INFERENCE_BACKEND_GROUP, registry.INFERENCE_BACKENDS),
    (registry.MODEL_FAMILY_GROUP, registry.MODEL_FAMILIES),
)


def _leaves(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, BaseModel | None, str]]:
    """(dotted path, value, the model holding the field or None, the field name) of every value in a config."""
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            value = getattr(obj, name)
            yield (*path, name), value, obj, name
            yield from _leaves(value, (*path, name))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield (*path, str(key)), value, None, ""
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield (*path, str(i)), value, None, ""
            yield from _leaves(value, (*path, str(i)))


def code_settings(cfg: BaseModel) -> list[tuple[str, Any, str]]:
    """(dotted key, value, why) of each setting in `cfg` that names code other than by a registered name."""
    targets = {path for group, builtin in GROUPS for path in registry.registered(group, builtin).values()}
    found = []
    for path, value, model, name in _leaves(cfg):
        key = ".".join(path)
        if isinstance(value, str) and registry.IMPORT_PATH.match(value) and value not in targets:
            found.append((key, value, "an import path, not a registered entry point"))
        elif model is not None and (why := RUNS_WHAT_IT_NAMES.get((type(model).__name__, name))):
            default = type(model).model_fields[name].get_default(call_default_factory=True)
            if value != default:
                found.append((key, value, why))
    return found


def refuse_untrusted(cfg: BaseModel, source: str, overrides: Sequence[tuple[str, str]]) -> None:
    """ValueError naming every code setting of `cfg` (read from `source`) the command line did not set again."""
    given = [tuple(p.replace("-", "_") for p in dotted.split(".")) for dotted, _ in overrides]
    found = [
        (key, value, why)
        for key, value, why in code_settings(cfg)
        if not any(tuple(key.split("."))[: len(g)] == g for g in given)
    ]
    if found:
        lines = "\n".join(f"  {key} = {value!r}: {why}" for key, value, why in found)
        raise ValueError(
            f"{source} names code that is not registered on this host:\n{lines}\n"
            "Whoever can write a run directory could have put it there, so it is not run. If you trust this run "
            "directory, resume with --trust-run-config (the resume-unfinished flow: trust_run_config=true), or set "
            "those keys again on the command line; a package's entry point (docs/environments.md) needs neither."
        )
