"""The load-time checks of `rollflow rl`, `sft`, `resume` and `eval` that need more than the config itself: the model
directory, the environments (their prompts measured with the model's tokenizer), the advantage estimators, the policy
loss, the distillation teacher and the inference backend's capabilities (and `auto`'s choice). Each refuses with a
ConfigError (exit code 2) naming the key and what would be valid, before anything starts; what was checked goes to
stderr, so stdout stays the command's result.
"""

from __future__ import annotations

import sys

from config.loader import ConfigError
from config.run import RunConfig


def check_loaded(cfg: RunConfig, env_sources: list[str]) -> None:
    """The load-time checks that need more than the config itself: the environments, the advantage estimators,
    the model directory and the inference backend's capabilities; each refuses with exit code 2 before anything
    starts."""
    check_model(cfg)  # first: the environments' prompts are measured with its tokenizer
    checked = check_envs(cfg, env_sources)
    check_advantages(cfg, env_sources)
    check_backend(cfg)
    check_loss(cfg)
    check_teacher(cfg)
    if cfg.eval.interval > 0:  # the orchestrator evaluates during the run: the same checks as `rollflow eval`
        from rollflow.evalcmd import check_eval

        check_eval(cfg, env_sources, "tag" if cfg.model.path is None else "instruct")
    report(checked)


def report(lines: list[str]) -> None:
    """What the load step checked (once every check passed), on stderr: stdout stays the command's result."""
    for line in lines:
        print(f"rollflow: checked {line}", file=sys.stderr)


def check_teacher(cfg: RunConfig) -> None:
    """A `[teacher]`: its directory reads, its tokenizer is the student's (it scores the student's token ids),
    and its inference backend runs its settings; exit code 2 otherwise, before anything starts."""
    if not cfg.teacher.enabled:
        return
    from config.transport import WeightBroadcastConfig
    from engines.inference.backend import check
    from engines.orchestrator.teacher import check_tokenizer
    from engines.registry import PluginError

    if cfg.teacher.inference.backend == "auto":
        raise ConfigError(
            "invalid teacher: teacher.inference.backend = 'auto' is the policy's only; name 'embedded' or 'vllm'"
        )
    try:
        check_tokenizer(cfg.model, cfg.teacher)
        check(cfg.teacher.inference, WeightBroadcastConfig())
    except (ValueError, PluginError) as exc:
        raise ConfigError(f"invalid teacher: {exc}") from None


def check_envs(cfg: RunConfig, env_sources: list[str], rl: bool = True) -> list[str]:
    """Build every `[[envs]]` plugin (importing its module), measure a sample of its first-turn prompts with the
    run's tokenizer and apply `RunConfig.env_problems` (prompts against model.max_seq_len for `rl`, sft.steps
    against environments without demonstrations): exit code 2 here, every problem at once, instead of in the
    orchestrator. `auto` prompts get the style the run's tokenizer picks (tag: the character tokenizer, instruct:
    a model directory's). Returns one line per environment for `report` (docs/environments.md)."""
    from engines.environments.loadcheck import inspect
    from engines.models.modeldir import load_tokenizer, resolve

    try:
        tok = load_tokenizer(resolve(cfg.model))
    except ValueError as exc:
        raise ConfigError(f"invalid model: {exc}") from None
    except Exception as exc:  # a tokenizer library's own error on files it cannot read
        raise ConfigError(
            f"invalid model: model.path={cfg.model.path!r}: the tokenizer does not load: {exc!r}"
        ) from None
    facts, problems = inspect(cfg.envs, env_sources, tok.prompt_style, tok)
    problems += cfg.env_problems(facts, rl)
    if problems:
        raise ConfigError("invalid environment:\n  " + "\n  ".join(problems))
    return [f.report() for f in facts]


def check_advantages(cfg: RunConfig, env_sources: list[str]) -> None:
    """Load every configured advantage estimator (`[orchestrator.advantage]`, each `[[envs]] advantage`; built in,
    entry point or import path), validate its parameters with its params class and call it once, so a bad one
    fails here, exit code 2, naming the key, instead of in the orchestrator after the warm-up."""
    from engines.orchestrator.estimators import check
    from engines.registry import PluginError

    try:
        check(cfg.orchestrator.advantage, cfg.envs, env_sources)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def check_model(cfg: RunConfig) -> None:
    """Read `model.path` (a directory, a fetched name or an org/name in the local Hugging Face cache) once,
    without torch, so a missing or incomplete one fails here, exit code 2, instead of after the warm-up
    starts; and check trainer.parallel against its config.json's shape and implementation (heads, experts:
    no tensor parallelism on MoE layers), as the run config does for a profile's own shape."""
    if cfg.model.path is None:
        return
    from config.trainer_parallel import check_against_model
    from engines.models.modeldir import is_vision, resolve

    try:
        source = resolve(cfg.model)
    except ValueError as exc:
        raise ConfigError(f"invalid model: {exc}") from None
    try:
        check_against_model(cfg.trainer.parallel, source.cfg, source.impl)
    except ValueError as exc:
        raise ConfigError(f"model.path={cfg.model.path!r} ({source.directory}/config.json): {exc}") from None
    if cfg.trainer.compute_dtype != "float32" and is_vision(source):  # transformers' VLMs read their parameters
        raise ConfigError(
            f"model.path={cfg.model.path!r} is a vision-language model: trainer.compute_dtype = "
            f"{cfg.trainer.compute_dtype!r} is not supported for one (its code reads the dtype from parameters "
            "the bf16 forward swaps out); use trainer.compute_dtype = 'float32'"
        )


def check_loss(cfg: RunConfig) -> None:
    """Load a plugin `trainer.loss.type` (an entry point or an import path) and validate its `args` with the
    plugin's own parameter model, exit code 2 on failure; built-in variants were validated with the config."""
    from config.loss import BUILTIN_LOSSES

    if cfg.trainer.loss.type in BUILTIN_LOSSES:
        return
    from engines.registry import PluginError
    from engines.trainer.losses.registry import probe, resolve

    try:
        spec, params = resolve(cfg.trainer.loss)
        probe(cfg.trainer.loss, spec, params)
    except PluginError as exc:
        raise ConfigError(f"invalid loss: {exc}") from None
    if spec.sequence_level and cfg.trainer.parallel.cp > 1:
        raise ConfigError(
            f"trainer.loss.type = {cfg.trainer.loss.type!r} reads whole samples, which context parallelism "
            f"splits (trainer.parallel.cp = {cfg.trainer.parallel.cp}); use cp = 1"
        )


def check_backend(cfg: RunConfig) -> None:
    """Load `inference.backend`'s declaration (import-light: no torch) and refuse, exit code 2, the settings
    its capabilities do not cover (replicas, collective weights, routed experts, deployment keys, recording
    the support top-k / top-p sampling kept, images for a vision-language model) here instead of when the
    inference process starts."""
    from engines.inference.auto import resolve_auto
    from engines.inference.backend import check
    from engines.registry import PluginError

    vision = False
    if cfg.model.path is not None:
        from engines.models.modeldir import is_vision, resolve

        vision = is_vision(resolve(cfg.model))  # check_model has already read the directory (a bad one exits there)
    choice = resolve_auto(cfg, vision)  # "auto" -> a named backend, stored in the run's config from here on
    if choice is not None:
        print(f"rollflow: {choice.line()}", file=sys.stderr)
    try:
        check(cfg.inference, cfg.weight_broadcast, cfg.orchestrator, cfg.trainer, vision=vision)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def keep_auto_choice(cfg: RunConfig) -> None:
    """`--resume` of a run whose backend "auto" chose: keep the stored choice (checked again against the settings)."""
    from engines.inference.auto import keep_stored
    from runtime.rundir import stored_config

    line = keep_stored(cfg, stored_config(cfg.output_dir, cfg.storage))
    if line is not None:
        print(f"rollflow: {line}", file=sys.stderr)
        check_backend(cfg)


def check_sft_data(cfg: RunConfig, env_sources: list[str]) -> None:
    """What `rollflow sft` reads before it starts: the model directory, the environments (their demonstrations
    as data), the files `[sft.data] path` names (listed, not read: rows are checked when the trainer loads
    them) or the lake's run directory; each refuses with exit code 2."""
    check_model(cfg)
    data = cfg.sft.data
    if data.type == "envs":
        report(check_envs(cfg, env_sources, rl=False))
        return
    from storage.fs import Storage

    if data.type == "lake":
        fs, root = Storage(cfg.storage).open(data.run)
        if not fs.exists(f"{root}/rollouts"):
            raise ConfigError(f"sft.data.run = {data.run!r} holds no rollouts/: not a rollflow RL run's output_dir")
        return
    from engines.trainer.sft_files import DataError, dataset_files

    fs, path = Storage(cfg.storage).open(data.path)
    try:
        dataset_files(fs, path, data.format)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
