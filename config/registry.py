"""The extension points, each registered in one place: names a profile may use -> where the code lives.

Values are import paths (`module:attribute`) or module names, never imports, so this stays in the
ground layer and validation needs neither torch nor the engines. Each extension point is also an
entry-point group: another package adds an environment, a model family or an inference backend by
registering it there (pyproject.toml `[project.entry-points."GROUP"]`), without editing rollflow.
engines/registry.py resolves a name to its object.
"""

from __future__ import annotations

import re

# `[[envs]] id` names an environment factory by an import path (`module:attribute`) or by an entry point
# in this group (docs/environments.md). rollflow's own are registered there too (pyproject.toml); this
# table repeats them so they resolve where rollflow's installed metadata predates them (an editable
# install from an older checkout), and tests/unit/test_env_plugins.py keeps the two equal.
# How a plugin is named: an import path `module:attribute`, or an entry point's name in its group.
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
ENTRY_POINT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_plugin_name(name: str) -> bool:
    """Whether `name` reads as an import path or an entry point name (whether it resolves is checked later)."""
    return bool(IMPORT_PATH.match(name) or (":" not in name and ENTRY_POINT.match(name)))


ENV_GROUP = "rollflow.envs"
ENVIRONMENTS: dict[str, str] = {
    "reverse-text": "engines.environments.base:reverse_text",
    "sort-letters": "engines.environments.base:sort_letters",
    "count-shapes": "engines.environments.shapes:count_shapes",  # images (engines/environments/shapes.py)
    "reasoning-gym": "engines.environments.rgym:load",
    "tool-lookup": "engines.environments.tools:tool_lookup",  # multi-turn (engines/environments/episodes.py)
    "long-hop": "engines.environments.longhop:long_hop",  # multi-turn, 20+ turns (long-horizon episodes)
    "verifiers": "engines.environments.verifiers_env:verifiers",  # verifiers (v1) environments (docs/environments.md)
    "openenv": "engines.environments.openenv_env:openenv",  # OpenEnv servers, run locally (docs/environments.md)
}
# The built-in string tasks: their `args.max_chars` bounds the prompt length the config checks.
STRING_TASKS = ("reverse-text", "sort-letters")

# `model.family` and config.json `model_type` -> the Family (engines/models/families.py) that maps its config.json
# fields to ModelConfig; rollflow's own model code (engines/models/decoder.py) implements these, except those
# whose Family says `hf_only` (transformers' modeling runs them).
MODEL_FAMILY_GROUP = "rollflow.model_families"
MODEL_FAMILIES: dict[str, str] = {
    "llama": "engines.models.families:LLAMA",
    "qwen3": "engines.models.families:QWEN3",
    "qwen3_moe": "engines.models.families:QWEN3_MOE",
    "qwen3_vl": "engines.models.families:QWEN3_VL",  # vision-language, model.impl = "hf" only (engines/models/vlm.py)
    "qwen3_vl_moe": "engines.models.families:QWEN3_VL_MOE",  # the same, with a Qwen3-MoE language model
}

# `inference.backend` -> the backend's declaration (engines/inference/backend.py `BackendSpec`: its capabilities
# and factory), which `python -m engines.inference` serves behind the one HTTP front end. pyproject.toml
# registers these in the group too; tests/unit/test_inference_plugins.py keeps the two equal.
INFERENCE_BACKEND_GROUP = "rollflow.inference_backends"
INFERENCE_BACKENDS: dict[str, str] = {
    "embedded": "engines.inference.embedded:BACKEND",
    "vllm": "engines.inference.vllm:BACKEND",
}

# `trainer.loss.type` -> the policy loss's `LossSpec` (engines/trainer/losses/base.py); its parameters are the
# variant's model in config/loss.py. pyproject.toml registers these in the group too (tests keep them equal).
LOSS_GROUP = "rollflow.losses"
LOSSES: dict[str, str] = {
    "masked_is": "engines.trainer.losses.builtin:MASKED_IS",
    "ppo_clip": "engines.trainer.losses.builtin:PPO_CLIP",
    "tis": "engines.trainer.losses.builtin:TIS",
    "mis": "engines.trainer.losses.builtin:MIS",
    "icepop": "engines.trainer.losses.builtin:ICEPOP",
    "cispo": "engines.trainer.losses.builtin:CISPO",
    "gspo": "engines.trainer.losses.builtin:GSPO",
    "ipo": "engines.trainer.losses.builtin:IPO",
}

# `[orchestrator.advantage] type` and `[[envs]] advantage.type` -> the estimator's `AdvantageSpec`
# (engines/orchestrator/advantages.py: the function and its params class), or an import path `module:attribute`.
# pyproject.toml registers these in the group too; tests/unit/test_advantage_plugins.py keeps the two equal.
ADVANTAGE_GROUP = "rollflow.advantages"
ADVANTAGES: dict[str, str] = {
    "grpo": "engines.orchestrator.advantages:GRPO",
    "rloo": "engines.orchestrator.advantages:RLOO",
    "reinforce_pp": "engines.orchestrator.advantages:REINFORCE_PP",
}

# component -> the module its process runs (`python -m MODULE --config FILE`); one each, whatever the backend.
COMPONENT_MODULES: dict[str, str] = {
    "warmup": "engines.trainer",
    "inference": "engines.inference",
    "teacher": "engines.inference",  # the distillation teacher's server ([teacher]): an inference process too
    "orchestrator": "engines.orchestrator",
    "trainer": "engines.trainer",
}


def registered(group: str, builtin: dict[str, str]) -> dict[str, str]:
    """name -> `module:attribute` of every entry of one extension point: rollflow's own (`builtin`) and every
    installed distribution's entry point in `group` (the first distribution wins where two register one name).
    Reads installed metadata only: nothing is imported, so validation stays fast and torch-free."""
    from importlib import metadata

    found: dict[str, str] = {}
    for ep in metadata.entry_points(group=group):
        found.setdefault(ep.name, ep.value)
    return {**builtin, **found}


def one_of(kind: str, name: str, builtin: dict[str, str], group: str) -> str:
    """`name` if registered (built in or by entry point), else a ValueError naming what is valid (pydantic
    reports it with the key)."""
    names = registered(group, builtin)
    if name not in names:
        raise ValueError(
            f"unknown {kind} {name!r}; registered: {', '.join(sorted(names))} (config/registry.py, or the "
            f"entry-point group {group!r} of an installed package)"
        )
    return name
