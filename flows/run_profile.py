"""The `rl` flow as a deployment starts it: from profile paths and dotted overrides, as `rollflow rl`
does, instead of a resolved config. What the Prefect UI's "Run with parameters" form shows.

profiles + overrides + output_dir -> `load_run_config` (validated; a bad key fails the flow run with the
loader's message) -> the `rl` flow's body, in this same flow run (one run in the UI, not two). The same for a
shared deployment (`shared-from-profile`) and, with `tenant_of`, a tenant run on one (docs/multitenant.md).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from config.loader import load_run_config
from config.run import RunConfig
from flows.rl import rl
from flows.shared import shared_deployment


@flow(name="rl-from-profile", log_prints=True)
def rl_profile(
    profiles: list[str],
    overrides: dict[str, Any] | None = None,
    output_dir: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    tenant_of: str | None = None,
    tenant: str | None = None,
) -> dict:
    """profiles: TOML paths relative to the working directory (ROLLFLOW_HOME); overrides: dotted keys to
    values as on the command line (e.g. {"max_steps": 200, "trainer.optim.lr": "3e-4"}); output_dir: where
    the run lives; tenant_of: a shared deployment's directory to run on as tenant `tenant` (docs/multitenant.md)."""
    cfg = _load(profiles, overrides, output_dir)
    return rl.fn(
        config=cfg.model_dump(mode="json"), overwrite=overwrite, resume=resume, tenant_of=tenant_of, tenant=tenant
    )


@flow(name="shared-from-profile", log_prints=True)
def shared_profile(profiles: list[str], deploy_dir: str, overrides: dict[str, Any] | None = None) -> dict:
    """A shared deployment (`rollflow shared up`) in `deploy_dir`, served until `rollflow shared down deploy_dir`
    or this flow run's cancellation: profiles' [model] is the backbone, [shared] its limits."""
    cfg = _load(profiles, overrides, deploy_dir)
    return shared_deployment.fn(config=cfg.model_dump(mode="json"))


def _load(profiles: list[str], overrides: dict[str, Any] | None, output_dir: str | None) -> RunConfig:
    pairs = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in (overrides or {}).items()]
    return load_run_config(profiles, pairs + ([("output_dir", output_dir)] if output_dir else []))
