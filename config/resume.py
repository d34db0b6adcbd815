"""Which config changes a resumed run may make."""

from __future__ import annotations

from config.envs import STRING_TASK_DEFAULTS, EnvSpec
from config.eval import EvalConfig
from config.inference import InferenceConfig
from config.orchestrator import OrchestratorConfig
from config.placement import SlurmPlacementConfig
from config.registry import STRING_TASKS
from config.run import RestartConfig, resolve_seed_keys
from config.sft import SFTConfig
from config.teacher import TeacherConfig
from config.tracking import TrackingConfig
from config.trainer import TrainerConfig

# Changing these mid-run would mix incompatible data in one run: other weights shapes, other prompts
# or token ids, another group structure. Everything else (learning rate, max_steps, ...) may change.
INCOMPATIBLE_ON_RESUME = ("model", "envs", "seed", "orchestrator.group_size", "sft")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _current_envs(config: dict) -> dict:
    """`envs` in today's form with the built-in string tasks' defaults filled in, so a run started with
    `name`/`min_chars` entries (before environments were plugins) compares equal to the same entries read
    now, and `max_chars = 8` equal to leaving it out."""
    try:
        envs = [EnvSpec.model_validate(e).model_dump(mode="json") for e in config.get("envs", [])]
    except ValueError:  # not valid any more: compare as stored, which reports the difference
        return config
    for env in envs:
        if env["id"] in STRING_TASKS:
            env["args"] = {**STRING_TASK_DEFAULTS, **env["args"]}
    return {**config, "envs": envs}


def _current_keys(config: dict) -> dict:
    """The seed's spellings as the keys stored now (`deployment.num_infer_replicas`, which earlier versions
    stored beside `inference.num_infer_replicas`; `orchestrator.normalize_advantages`, now
    `orchestrator.advantage`; `trainer.loss` without a `type`, now `masked_is`; no `[eval]`), with the keys
    added since at their defaults, so the same setting compares equal."""
    try:
        config = {"eval": {}, **resolve_seed_keys(config)}  # runs stored before [eval] existed: its defaults
        for name, model in (
            ("orchestrator", OrchestratorConfig),
            ("trainer", TrainerConfig),
            ("sft", SFTConfig),
            ("eval", EvalConfig),
            ("inference", InferenceConfig),
            ("restart", RestartConfig),
            ("tracking", TrackingConfig),
            ("deployment", SlurmPlacementConfig),
        ):
            if isinstance(config.get(name), dict):
                config = {**config, name: model.model_validate(config[name]).model_dump(mode="json")}
        return {"teacher": TeacherConfig().model_dump(mode="json"), **config}
    except ValueError:  # not valid any more: compare as stored, which reports the difference
        return config


def resume_changes(old: dict, new: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(incompatible, compatible) differences between a stored run config and a resume's config,
    each as {dotted key: (old, new)}."""
    a, b = _flatten(_current_envs(_current_keys(old))), _flatten(_current_envs(new))
    changed = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    for port in ("inference.port", "teacher.inference.port"):
        changed.pop(port, None)  # stored as picked at launch; each attempt picks again
    bad = {k: v for k, v in changed.items() if any(k == p or k.startswith(p + ".") for p in INCOMPATIBLE_ON_RESUME)}
    return bad, {k: v for k, v in changed.items() if k not in bad}
