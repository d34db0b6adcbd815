"""`rollflow` command line. Heavy imports (torch, Prefect, MLflow) happen only once a command runs,
so `--help`, validation and `--dry-run` are instant.

    rollflow rl @ profiles/tiny-cpu.toml [@ more.toml] [--trainer.optim.lr 3e-4] [--output-dir DIR]
                [--dry-run] [--overwrite]
    rollflow lake OUTPUT_DIR [--json] [--export FILE ...] [--plot DIR]   (rollflow/lake.py)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from rollflow.loader import ConfigError, load_run_config

USAGE = """rollflow rl [@ PROFILE.toml ...] [--KEY VALUE ...] [--dry-run] [--overwrite]

  @ FILE          a TOML profile; several compose left to right (later wins)
  --KEY VALUE     a dotted override applied after the profiles, e.g. --trainer.optim.lr 3e-4,
                  --output-dir runs/a (dashes in keys read as underscores); VALUE is a TOML literal
                  when it parses as one (3e-4, true, [1, 2]), a string otherwise
  --dry-run       validate, write the resolved per-component configs to OUTPUT_DIR/config/, exit
  --overwrite     replace an existing run in OUTPUT_DIR instead of refusing to start

Keys are documented in docs/configuration.md."""


def split_args(tokens: list[str]) -> tuple[list[str], list[tuple[str, str]], set[str]]:
    """Tokens -> (profiles, dotted overrides, flags). Raises ConfigError on malformed input."""
    profiles: list[str] = []
    overrides: list[tuple[str, str]] = []
    flags: set[str] = set()
    it = iter(tokens)
    for tok in it:
        if tok in ("--dry-run", "--overwrite"):
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


def cmd_rl(tokens: list[str]) -> int:
    profiles, overrides, flags = split_args(tokens)
    cfg = load_run_config(profiles, overrides)
    from storage.fs import configure

    configure(cfg.storage.model_dump(mode="json"))  # endpoint, timeouts, retries for the run-dir check
    from flows.prepare import RunDirError, claim_output_dir, new_run_id, run_exists, write_configs

    try:
        if "dry-run" in flags:
            if run_exists(cfg.output_dir):
                raise RunDirError(f"{cfg.output_dir} already holds a run; --dry-run would overwrite its configs")
        else:
            claim_output_dir(cfg.output_dir, overwrite="overwrite" in flags)
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None
    if "dry-run" in flags:
        urls = write_configs(cfg, new_run_id(cfg), f"http://{cfg.inference.host}:{cfg.inference.port}")
        print(json.dumps(urls, indent=2))
        return 0
    from flows.rl import rl
    from rollflow.redact import redact_url

    uri = cfg.tracking.tracking_uri
    if uri and redact_url(uri) != uri:  # credentials travel by environment, not as (stored) flow parameters
        os.environ["MLFLOW_TRACKING_URI"] = uri
        cfg.tracking.tracking_uri = None
    summary = rl(config=cfg.model_dump(mode="json"))
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="rollflow", description="Asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rl", help="run RL from profiles and overrides", usage=USAGE, add_help=False)
    sub.add_parser("lake", help="inspect a run's rollouts, weights and checkpoints (rollflow lake -h)", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "rl" and rest and rest[0] in ("-h", "--help"):
        print("usage: " + USAGE)
        return 0
    if command == "lake":
        from rollflow.lake import main as lake_main

        return lake_main(rest)
    if command != "rl":
        parser.error(f"unknown command {command!r} (choose from: rl, lake)")
    # SIGTERM unwinds like Ctrl-C, so the flow's cleanup stops every component it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return cmd_rl(rest)
    except ConfigError as exc:
        print(f"rollflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
