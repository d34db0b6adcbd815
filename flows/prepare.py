"""Run-directory bookkeeping the `rl` flow and `--dry-run` share: ids, ports, resolved configs."""

from __future__ import annotations

import secrets
import socket
import time

from rollflow.config import RunConfig, component_configs
from storage.fs import get_fs, join, write_json

COMPONENTS = ("sft", "inference", "orchestrator", "trainer")


def new_run_id(cfg: RunConfig) -> str:
    return f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_exists(output_dir: str) -> bool:
    fs, root = get_fs(output_dir)
    return any(fs.exists(join(root, d)) for d in ("weights", "rollouts", "checkpoints"))


def write_configs(
    cfg: RunConfig, run_id: str, inference_url: str, tracking_uri: str | None = None, mlflow_run_id: str | None = None
) -> dict[str, str]:
    """Write `config/run.json` and one resolved config per component; returns component -> config URL."""
    fs, root = get_fs(cfg.output_dir)
    slices = component_configs(cfg, run_id, inference_url, mlflow_run_id)
    trainer = slices["trainer"]
    trainer.tracking = trainer.tracking.model_copy(update={"tracking_uri": tracking_uri})  # type: ignore[attr-defined]
    write_json(fs, join(root, "config", "run.json"), {"run_id": run_id, **cfg.model_dump(mode="json")})
    urls = {}
    for name, sub in slices.items():
        path = join(root, "config", f"{name}.json")
        write_json(fs, path, sub.model_dump(mode="json"))
        urls[name] = cfg.output_dir.rstrip("/") + f"/config/{name}.json"
    return urls
