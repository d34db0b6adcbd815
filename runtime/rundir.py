"""Run-directory bookkeeping the `rl` and `sft` flows and `--dry-run` share: ids, ports, resolved configs."""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path

from config.process import component_configs, sft_run_config
from config.redact import redact_config, redact_url
from config.resume import resume_changes
from config.run import RunConfig
from config.storage import StorageConfig
from storage import runstate
from storage.fs import DEFAULT_SETTINGS, get_fs, is_local, join, write_bytes_atomic, write_json
from storage.metrics import SFT_DATA_FILE

# What a run owns inside OUTPUT_DIR; --overwrite removes exactly these, nothing else there (the lease
# stays: it belongs to whoever is claiming the directory right now).
RUN_ENTRIES = (
    "config",
    "tokenizer",
    "weights",
    "rollouts",
    "checkpoints",
    "evals",
    "logs",
    "metrics.jsonl",
    SFT_DATA_FILE,
    "mlflow.db",
    runstate.STATE_FILE,
    "shared_trainer.json",  # a shared deployment's report on this run as its tenant (runtime/tenancy.py)
)
DATA_ENTRIES = ("weights", "rollouts", "checkpoints")


class RunDirError(RuntimeError):
    """OUTPUT_DIR cannot be used as asked (holds a run, or data that is not a rollflow run)."""


def logs_dir(fs, root: str, run_id: str) -> str:
    """Component logs are appended line by line, which object stores cannot do: keep them on local disk."""
    if is_local(fs):
        return join(root, "logs")
    return str(Path("rollflow-logs", run_id).resolve())


def new_run_id(cfg: RunConfig) -> str:
    return f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_exists(output_dir: str, storage: StorageConfig = DEFAULT_SETTINGS) -> bool:
    """True when OUTPUT_DIR holds a rollflow run's data (not just the configs a --dry-run wrote)."""
    fs, root = get_fs(output_dir, storage)
    return any(fs.exists(join(root, d)) for d in DATA_ENTRIES)


def refuse_if_running(output_dir: str, storage: StorageConfig = DEFAULT_SETTINGS) -> None:
    """The CLI's early check; the flow itself relies on acquiring the lease."""
    fs, root = get_fs(output_dir, storage)
    lease = runstate.read_lease(fs, root)
    if runstate.is_live(lease):
        assert lease is not None
        raise RunDirError(f"{output_dir} is being run right now ({runstate.describe(lease)}); refusing to touch it")


def claim_output_dir(output_dir: str, overwrite: bool, storage: StorageConfig = DEFAULT_SETTINGS) -> None:
    """Refuse an existing run unless `overwrite`; never delete data that rollflow did not write."""
    if not run_exists(output_dir, storage):
        return
    fs, root = get_fs(output_dir, storage)
    if not fs.exists(join(root, "config", "run.json")):
        raise RunDirError(
            f"{output_dir} holds weights/, rollouts/ or checkpoints/ but no config/run.json: not a rollflow "
            "run, so it is left alone; choose another --output-dir"
        )
    if not overwrite:
        raise RunDirError(f"{output_dir} already holds a run; pass --overwrite to replace it, or another --output-dir")
    for entry in RUN_ENTRIES:
        if fs.exists(join(root, entry)):
            fs.rm(join(root, entry), recursive=True)


def stored_config(output_dir: str, storage: StorageConfig = DEFAULT_SETTINGS) -> dict:
    """The run config a run was last started with (`config/run.json`, credentials redacted)."""
    fs, root = get_fs(output_dir, storage)
    path = join(root, "config", "run.json")
    if not fs.exists(path) or runstate.read_state(fs, root) is None:
        raise RunDirError(f"{output_dir} holds no rollflow run to resume (no config/run.json and state.json)")
    return json.loads(fs.cat_file(path))


def check_resumable(cfg: RunConfig) -> dict[str, tuple]:
    """Refuse a resume when incompatible settings changed; returns the compatible changes (to record)."""
    stored = stored_config(cfg.output_dir, cfg.storage)
    stored.pop("run_id", None)
    bad, ok = resume_changes(stored, public_config(cfg))
    if bad:
        lines = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in bad.items())
        raise RunDirError(
            f"cannot resume {cfg.output_dir}: these settings differ from the run's and cannot change mid-run:\n"
            f"{lines}\nstart a new run (another --output-dir) to use them"
        )
    return ok


def public_config(cfg: RunConfig) -> dict:
    """The run config as JSON with credentials redacted (config/redact.py: URL user info, query-string tokens,
    secret-named environment values): what goes to disk and to MLflow params, and what a resume compares."""
    return redact_config(cfg.model_dump(mode="json"))


def write_run_config(cfg: RunConfig, run_id: str) -> None:
    """`config/run.json`: what `rollflow resume` restarts with, and what a resume is compared against."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    write_json(fs, join(root, "config", "run.json"), {"run_id": run_id, **public_config(cfg)})


def write_configs(
    cfg: RunConfig,
    run_id: str,
    inference_url: str,
    tracking_uri: str | None = None,
    mlflow_run_id: str | None = None,
    resume_step: int | None = None,
    plan: dict[str, str] | None = None,
    tenant: str | None = None,
) -> dict[str, str]:
    """Write `config/run.json`, one resolved config per component, and the inference backend's launch plan
    (`plan`: file name -> text, engines/inference/backend.py `launch_plan`); returns component -> config URL.
    `tenant`: a shared deployment's tenant run, whose orchestrator and trainer configs are all it runs."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    slices = component_configs(cfg, run_id, inference_url, mlflow_run_id, resume_step, tenant)
    if tenant is not None:  # the deployment serves and trains it: no inference, teacher or warm-up of its own
        slices = {k: v for k, v in slices.items() if k in ("orchestrator", "trainer")}
    trainer = slices["trainer"]
    # The trainer gets the full URI through its environment; files on disk keep a redacted copy.
    trainer.tracking = trainer.tracking.model_copy(update={"tracking_uri": redact_url(tracking_uri)})  # type: ignore[attr-defined]
    write_run_config(cfg, run_id)
    urls = {}
    for name, sub in slices.items():
        path = join(root, "config", f"{name}.json")
        write_json(fs, path, sub.model_dump(mode="json"))
        urls[name] = cfg.output_dir.rstrip("/") + f"/config/{name}.json"
    for name, text in (plan or {}).items():
        write_bytes_atomic(fs, join(root, "config", name), text.encode())
    return urls


def write_sft_configs(
    cfg: RunConfig,
    run_id: str,
    tracking_uri: str | None = None,
    mlflow_run_id: str | None = None,
    resume_step: int | None = None,
) -> dict[str, str]:
    """A `rollflow sft` run's `config/run.json` and `config/sft.json` (its one component); returns {"sft": URL}."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    sub = sft_run_config(cfg, run_id, mlflow_run_id, resume_step)
    assert sub.sft_run is not None
    # The trainer gets the full URI through its environment; files on disk keep a redacted copy.
    sub.sft_run.tracking = sub.sft_run.tracking.model_copy(update={"tracking_uri": redact_url(tracking_uri)})
    write_run_config(cfg, run_id)
    write_json(fs, join(root, "config", "sft.json"), sub.model_dump(mode="json"))
    return {"sft": cfg.output_dir.rstrip("/") + "/config/sft.json"}
