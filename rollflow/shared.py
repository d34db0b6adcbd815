"""`rollflow shared up|down|status` and the tenant side of `rollflow rl|resume --tenant-of DEPLOY_DIR`
(docs/multitenant.md). Heavy imports (Prefect, the flows) happen only once a command runs.

    rollflow shared up @ base.toml --deploy-dir D [--KEY VALUE ...] [--dry-run]    serves until `shared down`
    rollflow shared down D [--timeout-s S]                                          asks it to stop, waits
    rollflow shared status D                                                        JSON: state, tenants
    rollflow rl @ tenant.toml --tenant-of D [--tenant NAME] [--dry-run]             a tenant run
    rollflow resume T --tenant-of D [--tenant NAME]                                 resume it (on D, or another)
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from config.loader import ConfigError
from config.run import RunConfig

SHARED_USAGE = """rollflow shared up @ BASE.toml [@ more.toml] --deploy-dir DIR [--KEY VALUE ...] [--dry-run]
       rollflow shared down DIR [--timeout-s S]
       rollflow shared status DIR

  up:     start a shared deployment in DIR: the profile's [model] is the backbone (its warm-up publishes
          DIR/weights/step=000000), [shared] bounds tenants and LoRA ranks; one inference server and one
          trainer serve every tenant run (`rollflow rl @ tenant.toml --tenant-of DIR`) until `down`.
  down:   stop the deployment in DIR (its processes get SIGTERM), waiting up to S seconds (default 60).
  status: the deployment's state, its record and each attached tenant's progress, as JSON.
  docs/multitenant.md explains tenants, isolation and limits."""

DOWN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TenantArgs:
    deploy_dir: str
    name: str | None


def pop_tenant(overrides: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], TenantArgs | None]:
    """`--tenant-of D [--tenant NAME]` out of the dotted overrides (split_args reads them as overrides)."""
    keys = {"tenant-of", "tenant_of", "tenant"}
    found = {k.replace("_", "-"): v for k, v in overrides if k in keys}
    rest = [(k, v) for k, v in overrides if k not in keys]
    if "tenant" in found and "tenant-of" not in found:
        raise ConfigError("--tenant NAME names a tenant of a shared deployment: add --tenant-of DEPLOY_DIR")
    if "tenant-of" not in found:
        return rest, None
    return rest, TenantArgs(found["tenant-of"], found.get("tenant"))


def check_tenant(cfg: RunConfig, args: TenantArgs):
    """The deployment `cfg` attaches to (runtime/tenancy.py SharedTarget); exit code 2 with every problem."""
    from runtime.tenancy import TenantError, check_tenant, default_tenant_name

    try:
        return check_tenant(cfg, args.deploy_dir, args.name or default_tenant_name(cfg))
    except (TenantError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def tenant_dry_run(cfg: RunConfig, args: TenantArgs) -> dict:
    """What a tenant run would launch, its configs written to OUTPUT_DIR/config/ (nothing registered)."""
    from config.registry import COMPONENT_MODULES
    from runtime.rundir import new_run_id, write_configs
    from storage.tenants import tenant_path

    target = check_tenant(cfg, args)
    urls = write_configs(cfg, new_run_id(cfg), target.deployment.inference_url, tenant=target.name)
    return {
        "tenant": target.name,
        "deployment": args.deploy_dir,
        "inference_url": target.deployment.inference_url,
        "record": tenant_path(args.deploy_dir, target.name),
        "backbone": f"{target.deployment.backbone_dir} -> {cfg.output_dir.rstrip('/')}/weights/step=000000",
        "launch": {
            "orchestrator": f"{sys.executable} -m {COMPONENT_MODULES['orchestrator']} --config {urls['orchestrator']}"
        },
        "trainer": f"the deployment's shared trainer reads {urls['trainer']}",
        **urls,
    }


def run_tenant(cfg: RunConfig, flags: set[str], args: TenantArgs, launch: Callable[..., int]) -> int:
    if "dry-run" in flags:
        print(json.dumps(tenant_dry_run(cfg, args), indent=2))
        return 0
    target = check_tenant(cfg, args)
    return launch(cfg, flags, "rl", tenant_of=args.deploy_dir, tenant=target.name)


def cmd_shared(tokens: list[str], launch_flow: Callable[[Callable[[], dict]], dict]) -> int:
    if not tokens or tokens[0] not in ("up", "down", "status"):
        raise ConfigError("usage: " + SHARED_USAGE)
    verb, rest = tokens[0], tokens[1:]
    if verb == "up":
        return _up(rest, launch_flow)
    if not rest or rest[0].startswith("-"):
        raise ConfigError("usage: " + SHARED_USAGE)
    from runtime.shared import status

    if verb == "status":
        if len(rest) != 1:
            raise ConfigError("usage: " + SHARED_USAGE)
        print(json.dumps(status(rest[0]), indent=2))
        return 0
    timeout = DOWN_TIMEOUT_S
    if len(rest) == 3 and rest[1] in ("--timeout-s", "--timeout_s"):
        try:
            timeout = float(rest[2])
        except ValueError:
            raise ConfigError(f"--timeout-s takes seconds, not {rest[2]!r}") from None
    elif len(rest) != 1:
        raise ConfigError("usage: " + SHARED_USAGE)
    return _down(rest[0], timeout)


def _up(tokens: list[str], launch_flow: Callable[[Callable[[], dict]], dict]) -> int:
    from config.loader import load_with_sources
    from rollflow.checks import check_loaded
    from rollflow.cli import split_args
    from runtime.shared import shared_problems

    profiles, overrides, flags = split_args(tokens)
    deploy = [v for k, v in overrides if k in ("deploy-dir", "deploy_dir")]
    if len(deploy) != 1 or flags - {"dry-run"}:
        raise ConfigError("usage: " + SHARED_USAGE)
    overrides = [(k, v) for k, v in overrides if k not in ("deploy-dir", "deploy_dir")] + [("output_dir", deploy[0])]
    cfg, env_sources = load_with_sources(profiles, overrides)
    if problems := shared_problems(cfg):
        raise ConfigError("not a shared deployment profile:\n  " + "\n  ".join(problems))
    check_loaded(cfg, env_sources)
    _refuse_if_up(cfg)
    if "dry-run" in flags:
        print(json.dumps(_plan(cfg), indent=2))
        return 0

    def run() -> dict:
        from flows.shared import shared_deployment

        return shared_deployment(config=cfg.model_dump(mode="json"))

    print(json.dumps(launch_flow(run), indent=2))
    return 0


def _refuse_if_up(cfg: RunConfig) -> None:
    from runtime.rundir import RunDirError, refuse_if_running

    try:
        refuse_if_running(cfg.output_dir, cfg.storage)
    except RunDirError as exc:
        raise ConfigError(f"a shared deployment is up in {cfg.output_dir}: {exc}") from None


def _plan(cfg: RunConfig) -> dict:
    """What `shared up` would start (nothing is written: the configs name the backbone the warm-up makes)."""
    from runtime.shared import SHARED_COMPONENTS, backbone_committed

    d = cfg.output_dir.rstrip("/")
    launch = {
        name: f"{sys.executable} -m {module} --config {d}/config/{'shared_trainer' if name == 'trainer' else name}.json"
        for name, module in SHARED_COMPONENTS.items()
    }
    warmup = None if backbone_committed(cfg) else f"{sys.executable} -m engines.trainer --config {d}/config/sft.json"
    return {
        "deploy_dir": d,
        "warmup": warmup,
        "launch": launch,
        "shared": cfg.shared.model_dump() if cfg.shared else None,
    }


def _down(deploy_dir: str, timeout_s: float) -> int:
    """Ask the supervisor to stop and wait (bounded) until its state says down; exit code 1 on timeout."""
    from runtime.shared import clear_stop, read_state, request_stop
    from storage import runstate
    from storage.fs import get_fs

    fs, root = get_fs(deploy_dir)
    state = read_state(deploy_dir)
    if not runstate.is_live(runstate.read_lease(fs, root)):
        clear_stop(deploy_dir)
        print(json.dumps({"deploy_dir": deploy_dir, "state": (state or {}).get("state", "absent"), "running": False}))
        return 0
    request_stop(deploy_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(deploy_dir)
        if state and state.get("state") in ("down", "failed"):
            print(json.dumps({"deploy_dir": deploy_dir, "state": state["state"], "running": False}))
            return 0
        time.sleep(0.2)
    print(f"rollflow: {deploy_dir} did not stop within {timeout_s:.0f}s (state {state})", file=sys.stderr)
    return 1
