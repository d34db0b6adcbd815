"""`rollflow submit`: the run as one Slurm job, without a Prefect server, and what `--dry-run` shows
of it.

    rollflow submit @ profile.toml [--KEY VALUE ...] [--overwrite | --resume]

The job runs `rollflow rl` with the same profiles (absolute paths) and overrides inside the allocation,
where the flow places its components as srun steps (launch/slurm.py); it reports to PREFECT_API_URL if
that is set in the job's environment (sbatch exports the submitting shell's environment), otherwise to
a temporary local API as a local run does. The Slurm job id is printed on the last line.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from config.run import RunConfig
from storage.fs import get_fs, is_local, join, write_bytes_atomic, write_json

SCRIPT_NAME = "slurm.sbatch"
PLACEMENT_NAME = "slurm-placement.json"


TRACKING_URI_KEY = "tracking.tracking_uri"


def job_command(profiles: list[str], overrides: list[tuple[str, str]], flags: set[str]) -> str:
    """The job's `rollflow rl` line. It is written into the batch script, so it holds no credential: a tracking
    URI with credentials reaches the job as MLFLOW_TRACKING_URI (sbatch exports the submitting environment;
    `rollflow submit` sets it), and any other override carrying one is refused."""
    from config.redact import redact_text

    argv = [sys.executable, "-m", "rollflow.cli", "rl"]
    for path in profiles:
        argv += ["@", str(Path(path).resolve())]
    for key, value in overrides:
        if redact_text(value) != value:
            if key.replace("-", "_") == TRACKING_URI_KEY:
                continue
            raise ValueError(
                f"--{key} {redact_text(value)!r} carries a credential, which would be written into the batch "
                "script: give it by environment instead"
            )
        argv += [f"--{key}", value]
    argv += [f"--{f}" for f in sorted(flags & {"overwrite", "resume"})]
    return shlex.join(argv)


def _job_output(cfg: RunConfig) -> str:
    """Slurm writes the job's output itself: a local directory (the run's logs/ when it is local)."""
    fs, root = get_fs(cfg.output_dir, cfg.storage)
    base = Path(join(root, "logs")) if is_local(fs) else Path("slurm-logs")
    return str(base.resolve() / "slurm-%j.out")


def render_job(cfg: RunConfig, command: str) -> str:
    from launch.slurm import render_sbatch

    return render_sbatch(
        cfg.placement.slurm, cfg.placement.nodes, f"rollflow-{cfg.run_name}", command, {}, _job_output(cfg)
    )


def write_preview(cfg: RunConfig, command: str) -> dict[str, str]:
    """--dry-run: the batch script `rollflow submit` would submit and the srun placement, in config/."""
    from launch.slurm import render_placement

    fs, root = get_fs(cfg.output_dir, cfg.storage)
    script = join(root, "config", SCRIPT_NAME)
    write_bytes_atomic(fs, script, render_job(cfg, command).encode())
    placement = render_placement(cfg.placement, cfg.trainer.parallel, teacher=cfg.teacher.enabled)
    write_json(fs, join(root, "config", PLACEMENT_NAME), placement)
    base = cfg.output_dir.rstrip("/") + "/config/"
    return {"slurm": base + SCRIPT_NAME, "slurm_placement": base + PLACEMENT_NAME}


def submit(cfg: RunConfig, command: str) -> str:
    """Write the script next to the run's configs and sbatch it; returns the job id."""
    from runtime.slurm import submit as sbatch
    from runtime.slurm import write_script

    out = Path(_job_output(cfg)).parent
    out.mkdir(parents=True, exist_ok=True)  # Slurm does not create the output's directory
    script = out / f"{cfg.run_name}.sbatch"
    write_script(script, render_job(cfg, command))
    job_id = sbatch(str(script))
    print(json.dumps({"script": str(script), "output": str(out / f"slurm-{job_id}.out")}))
    return job_id
