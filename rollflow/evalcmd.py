"""`rollflow eval`: what is evaluated (the target), the load-time checks, and the launch of the `eval` flow.

    rollflow eval @ PROFILE.toml [--model PATH | --run OUTPUT_DIR --step N] [--overwrite] [--KEY VALUE ...]
    rollflow eval --compare BEFORE_DIR AFTER_DIR

The profile gives the environments, `[eval]` settings, the inference backend and storage; the target is
`--model`'s directory, publication N of `--run`'s run (its own stored model config), or the profile's model.
Every refusal (no held-out split, a missing publication, a results folder made with other settings) exits
with code 2 before Prefect starts. Heavy imports wait until the command runs.
"""

from __future__ import annotations

import json
import os
import re
import sys

from config.eval import EvalTarget
from config.loader import ConfigError, load_with_sources
from config.run import RunConfig

EVAL_USAGE = """rollflow eval [@ PROFILE.toml ...] [--model PATH | --run OUTPUT_DIR --step N] [--overwrite]
                     [--KEY VALUE ...]
       rollflow eval --compare BEFORE_DIR AFTER_DIR

  Evaluate a model on the held-out split of the profile's environments (or eval.envs), with the profile's
  [eval] settings (eval.num_tasks, eval.n, eval.temperature, eval.k, ...; docs/evaluation.md) and inference
  backend. Prints a table (stderr: a progress bar) and the summary as JSON.

  --model PATH        a Hugging Face model directory (or a fetched name), its own weights
  --run DIR --step N  policy version N of the run in DIR (DIR/weights/step=N, checksums verified), with the
                      model config the run was started with
  (neither)           the profile's model.path
  --overwrite         replace the results of an earlier evaluation with other settings under the same name

  Results: <eval.output_dir>/evals/<eval.name>/ (samples as Arrow shards, _summary.json). eval.output_dir
  defaults to DIR with --run, else to the profile's output_dir; eval.name defaults to step-NNNNNN with
  --run, else to the model directory's name. A killed evaluation continues where it stopped when the same
  command runs again. MLflow: a run `eval-<name>` in the results' tracking store.

  --compare           the paired difference AFTER - BEFORE of two evaluations' results folders (evals/<name>)
                      over the tasks both evaluated: per environment, the mean change of a task's reward with
                      its 95% interval (JSON)."""

TARGET_FLAGS = ("--model", "--run", "--step")


def take_target_flags(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """Pull --model/--run/--step VALUE out of the tokens (they are not config keys); the rest stays."""
    picked: dict[str, str] = {}
    rest: list[str] = []
    it = iter(tokens)
    for tok in it:
        flag, eq, value = tok.partition("=")
        if flag in TARGET_FLAGS:
            value = value if eq else next(it, "")
            if not value or value.startswith("--"):
                raise ConfigError(f"{flag} needs a value; usage:\n" + EVAL_USAGE)
            picked[flag[2:]] = value
        else:
            rest.append(tok)
    return picked, rest


def _safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"
    return name[:100]


def resolve_target(cfg: RunConfig, picked: dict[str, str]) -> EvalTarget:
    if "model" in picked and ("run" in picked or "step" in picked):
        raise ConfigError("--model and --run/--step exclude each other: evaluate a model directory, or a run's step")
    if ("run" in picked) != ("step" in picked):
        raise ConfigError("--run OUTPUT_DIR and --step N go together (policy version N of that run)")
    if "run" in picked:
        return _run_target(cfg, picked["run"], picked["step"])
    model = cfg.model.model_copy(update={"path": picked["model"]}) if "model" in picked else cfg.model
    if model.path is None:
        raise ConfigError(
            "the profile's model has no weights of its own (model.path is unset: the built-in model is trained by "
            "the warm-up); give --model PATH, or --run OUTPUT_DIR --step N to evaluate a run's policy"
        )
    from engines.models.modeldir import resolve

    try:
        directory = resolve(model).directory
    except ValueError as exc:
        raise ConfigError(f"invalid --model: {exc}") from None
    name = cfg.eval.name or _safe_name(os.path.basename(str(directory).rstrip("/")))
    out = cfg.eval.output_dir or cfg.output_dir
    return EvalTarget(model=model, output_dir=out, name=name, describe={"model": str(directory)})


def _run_target(cfg: RunConfig, run_dir: str, step_text: str) -> EvalTarget:
    """Publication `step` of the run in `run_dir`: the folder must be committed, inside the run, and every file
    must match its manifest's checksum."""
    from config.model import ModelConfig
    from runtime.rundir import RunDirError, stored_config
    from storage import weights
    from storage.fs import CorruptError, get_fs, is_committed, read_manifest, read_verified

    if not step_text.isdigit():
        raise ConfigError(f"--step {step_text!r}: a policy version, a non-negative integer")
    step = int(step_text)
    try:
        stored = stored_config(run_dir, cfg.storage)
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None
    fs, root = get_fs(run_dir, cfg.storage)
    directory = weights.version_dir(root, step)
    _inside(fs, root, directory)
    if not is_committed(fs, directory):
        have = weights.latest_version(fs, root)
        raise ConfigError(f"--step {step}: {directory} is not a committed publication (newest: {have})")
    try:
        manifest = read_manifest(fs, directory)
        for name in manifest["files"]:
            read_verified(fs, directory, name, manifest)
    except CorruptError as exc:
        raise ConfigError(f"--run {run_dir} --step {step}: {exc}") from None
    model = ModelConfig.model_validate(stored["model"])
    sha = manifest.get("model_sha256")
    describe = {"run": run_dir, "run_id": stored.get("run_id"), "step": step, "model_sha256": sha}
    name = cfg.eval.name or f"step-{step:06d}"
    return EvalTarget(model=model, run_dir=run_dir, step=step, output_dir=cfg.eval.output_dir or run_dir, name=name,
                      describe=describe)  # fmt: skip


def _inside(fs, root: str, directory: str) -> None:
    """A local publication folder must resolve (symlinks followed) to a path inside the run."""
    from storage.fs import is_local

    if not is_local(fs):
        return
    real_root, real = os.path.realpath(root), os.path.realpath(directory)
    if os.path.commonpath([real_root, real]) != real_root:
        raise ConfigError(f"{directory} resolves to {real}, outside the run {real_root}; refusing to read it")


def check_eval(cfg: RunConfig, env_sources: list[str], style: str) -> None:
    """Every evaluated environment has a single-turn held-out split of at least eval.num_tasks tasks."""
    from engines.environments.plugins import PluginError, build
    from engines.orchestrator.evaluation import unevaluable

    names = set(cfg.eval.envs or [s.label for s in cfg.envs])
    problems = []
    for i, (spec, source) in enumerate(zip(cfg.envs, env_sources, strict=True)):
        if spec.label not in names:
            continue
        try:
            env = build(spec, style)
        except PluginError as exc:
            problems.append(f"{source}: envs[{i}] (name {spec.label!r}, id {spec.id!r}): {exc}")
            continue
        why = unevaluable(env)
        size = getattr(env, "eval_size", 0)
        if why is None and size < cfg.eval.num_tasks:
            why = f"its held-out split has {size} tasks, fewer than eval.num_tasks = {cfg.eval.num_tasks}"
        if why:
            problems.append(f"{source}: envs[{i}] (name {spec.label!r}, id {spec.id!r}) cannot be evaluated: {why}")
    if problems:
        raise ConfigError(
            "evaluation needs held-out splits (set eval.envs to evaluate others only):\n  " + "\n  ".join(problems)
        )


def _claim(cfg: RunConfig, target: EvalTarget, overwrite: bool) -> None:
    from engines.orchestrator.evaluation import spec_for
    from storage import evals
    from storage.fs import get_fs

    fs, root = get_fs(target.output_dir, cfg.storage)
    try:
        evals.claim(fs, evals.eval_dir(root, target.name), spec_for(cfg, target.describe), overwrite)
    except evals.EvalStoreError as exc:
        raise ConfigError(str(exc)) from None


def compare(before: str, after: str) -> dict:
    """The paired difference of two evaluations' per-task mean rewards (engines/orchestrator/eval_metrics.py)."""
    from engines.orchestrator.eval_metrics import paired_difference, task_means
    from storage import evals
    from storage.fs import CorruptError, get_fs

    means = []
    for directory in (before, after):
        fs, root = get_fs(directory)
        try:
            table = evals.read_samples(fs, root)
        except (CorruptError, OSError) as exc:
            raise ConfigError(f"cannot read the evaluation in {directory}: {exc}") from None
        if table.num_rows == 0:
            raise ConfigError(f"{directory} holds no committed evaluation samples (an evals/<name> folder?)")
        cols = table.select(["env", "task_index", "reward"]).to_pydict()
        means.append(task_means(zip(cols["env"], cols["task_index"], cols["reward"], strict=True)))
    try:
        return paired_difference(*means)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cmd_eval(tokens: list[str]) -> int:
    from rollflow.checks import check_loaded
    from rollflow.cli import split_args, with_prefect_api

    if tokens[:1] == ["--compare"]:
        if len(tokens) != 3:
            raise ConfigError("usage: rollflow eval --compare BEFORE_DIR AFTER_DIR (two evals/<name> folders)")
        print(json.dumps(compare(tokens[1], tokens[2]), indent=1))
        return 0

    picked, rest = take_target_flags(tokens)
    profiles, overrides, flags = split_args(rest)
    if flags - {"overwrite"}:
        other = sorted("--" + f for f in flags - {"overwrite"})
        raise ConfigError(f"rollflow eval takes --overwrite only, not {other}")
    cfg, env_sources = load_with_sources(profiles, overrides)
    check_loaded(cfg, env_sources)
    target = resolve_target(cfg, picked)
    check_eval(cfg, env_sources, "tag" if target.model.path is None else "instruct")
    _claim(cfg, target, "overwrite" in flags)

    def run() -> dict:
        from flows.eval import evaluate

        return evaluate(config=cfg.model_dump(mode="json"), target=target.model_dump(mode="json"))

    summary = with_prefect_api(run)
    from storage.lake import render_eval

    print(render_eval(target.name, summary))
    print(json.dumps(summary, indent=1))
    sys.stdout.flush()
    return 0
