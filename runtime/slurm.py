"""Talk to Slurm through its CLI (sbatch, squeue, scontrol, sacct, scancel): submit a rendered batch
script, follow a job, expand the allocation's node list into the placement launch/slurm.py computes.

No Prefect here: the Slurm worker (flows/slurm_worker.py), the `rl` flow and `rollflow submit` share it.
Slurm >= 22.05 through its CLI only. Every command is bounded by COMMAND_TIMEOUT_S: a controller that does not
answer is SlurmTimeout (the worker's poll logs it and polls again), never a wait without end.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from config.placement import SlurmPlacementConfig
from launch.slurm import place
from storage.fs import fsync_dir


class SlurmNotFound(RuntimeError):
    """The Slurm commands are not on PATH."""


class SbatchRejected(RuntimeError):
    """sbatch refused the job; the message is Slurm's own."""


class SlurmTimeout(RuntimeError):
    """A Slurm command did not finish within COMMAND_TIMEOUT_S (the controller is down or overloaded)."""


COMMAND_TIMEOUT_S = 120.0  # above Slurm's own MessageTimeout (10 s by default) times its retries


def _slurm(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a Slurm command, its output captured, bounded by COMMAND_TIMEOUT_S."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired:
        raise SlurmTimeout(f"'{' '.join(argv)}' did not finish in {COMMAND_TIMEOUT_S:.0f}s") from None


def require(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise SlurmNotFound(
            f"'{command}' is not on PATH: this machine has no Slurm client (install slurm-client, load the "
            "cluster's Slurm module, or run on a login node)"
        )
    return path


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (`node[01-04],gpu7`) with `scontrol show hostnames`."""
    out = _slurm([require("scontrol"), "show", "hostnames", nodelist], check=True)
    return out.stdout.split()


def allocation_nodes(dep: SlurmPlacementConfig, env: Mapping[str, str] = os.environ) -> dict[str, list[str]] | None:
    """Inside a Slurm job: component -> its nodes. Outside one (no SLURM_JOB_ID): None, run locally."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return place(dep, hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")))


def write_script(path: Path, text: str) -> None:
    """Write a batch script atomically, readable by its owner only (the worker's carries the Prefect API
    settings). The temporary file gets a random name and is created with O_EXCL (mkstemp): a file or a
    symlink another user planted at a predictable name in the directory is never opened or followed; the
    rename then replaces whatever is at `path` itself, a symlink included, without following it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself survives a crash of the node
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def submit(script_path: str, cwd: str | None = None) -> str:
    """sbatch the script; returns the job id. Raises SbatchRejected with Slurm's message."""
    proc = _slurm([require("sbatch"), "--parsable", script_path], cwd=cwd)
    if proc.returncode != 0:
        raise SbatchRejected((proc.stderr or proc.stdout).strip() or f"sbatch exited with code {proc.returncode}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, reason/exit code) of a job, from squeue while it is queued or running, then scontrol
    (until MinJobAge), then sacct where accounting is on; (None, None) when Slurm has forgotten it."""
    out = _slurm([require("squeue"), "-h", "-j", job_id, "-o", "%T|%r"])
    if out.returncode == 0 and out.stdout.strip():
        state, _, reason = out.stdout.strip().partition("|")
        return state, None if reason in ("None", "") else reason
    out = _slurm([require("scontrol"), "show", "job", job_id])
    m = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", out.stdout, re.S)
    if out.returncode == 0 and m:
        return m.group(1), f"exit code {m.group(2)}"
    if shutil.which("sacct"):
        argv = ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"]
        out = _slurm(argv)
        if out.returncode == 0 and out.stdout.strip():
            state, _, code = out.stdout.strip().splitlines()[0].partition("|")
            return state.split()[0], f"exit code {code}"
    return None, None


def steps(job_id: str) -> list[str]:
    """Names of the job's running steps (squeue -s), e.g. ['batch', 'rollflow-inference', ...]."""
    out = _slurm([require("squeue"), "-h", "-s", "-j", job_id, "-o", "%j"])
    return out.stdout.split() if out.returncode == 0 else []


def requeued(env: Mapping[str, str] = os.environ) -> bool:
    """This batch job runs again after a requeue (a preemption, `scontrol requeue`, a node failure with
    --requeue): Slurm reruns the same script with SLURM_RESTART_COUNT >= 1 (unset or 0 the first time)."""
    count = env.get("SLURM_RESTART_COUNT", "")
    return count.isdigit() and int(count) > 0


def cancel(job_id: str) -> None:
    _slurm([require("scancel"), job_id], check=False)


ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}
# Pending reasons that no amount of waiting resolves: the request exceeds what the partition allows.
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidQOS"}
