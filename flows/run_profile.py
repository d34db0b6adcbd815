"""The `rl` flow as a deployment starts it: from profile paths and dotted overrides, as `rollflow rl`
does, instead of a resolved config. What the Prefect UI's "Run with parameters" form shows.

profiles + overrides + output_dir -> `load_run_config` (validated; a bad key fails the flow run with the
loader's message) -> the `rl` flow's body, in this same flow run (one run in the UI, not two).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from config.loader import load_run_config
from flows.rl import rl


@flow(name="rl-from-profile", log_prints=True)
def rl_profile(
    profiles: list[str],
    overrides: dict[str, Any] | None = None,
    output_dir: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
) -> dict:
    """profiles: TOML paths relative to the working directory (ROLLFLOW_HOME); overrides: dotted keys to
    values as on the command line (e.g. {"max_steps": 200, "trainer.optim.lr": "3e-4"}); output_dir: where
    the run lives."""
    pairs = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in (overrides or {}).items()]
    cfg = load_run_config(profiles, pairs + ([("output_dir", output_dir)] if output_dir else []))
    return rl.fn(config=cfg.model_dump(mode="json"), overwrite=overwrite, resume=resume)
