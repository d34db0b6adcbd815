"""Slurm from rollflow's side: render the sbatch script, place components on the allocated nodes as
`srun` job steps, and talk to Slurm through its CLI (sbatch, squeue, scontrol, sacct, scancel).

Data flow: `DeploymentConfig` -> `render_sbatch` (one job per run; `rollflow submit`, the Slurm worker,
`--dry-run`) -> inside the job the flow calls `allocation_placement` -> per-component node lists ->
`srun_prefix` put in front of each component's command by `tasks.components`. No Prefect here: the
worker (flows/slurm_worker.py) and the CLI share it. Slurm >= 22.05 through its CLI only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from config.deployment import DeploymentConfig, SlurmJobConfig
from config.parallel import ParallelConfig
from tasks.torchrun import torchrun_args

COMPONENTS = ("warmup", "inference", "orchestrator", "trainer")
# Slurm's walltime warning reaches the batch shell (sbatch --signal=B:USR1@N); the shell turns it into
# this file, which the flow watches: the flow itself may run under a Prefect runner that USR1 would kill.
WALLTIME_FILE_ENV = "ROLLFLOW_WALLTIME_FILE"
WALLTIME_GRACE_ENV = "ROLLFLOW_WALLTIME_GRACE_S"  # how long the flow waits for a checkpoint after it


class SlurmNotFound(RuntimeError):
    """The Slurm commands are not on PATH."""


class SbatchRejected(RuntimeError):
    """sbatch refused the job; the message is Slurm's own."""


class PlacementError(RuntimeError):
    """The allocation does not match the profile's deployment section."""


def require(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise SlurmNotFound(
            f"'{command}' is not on PATH: this machine has no Slurm client (install slurm-client, load the "
            "cluster's Slurm module, or run on a login node)"
        )
    return path


def place(dep: DeploymentConfig, hosts: Sequence[str]) -> dict[str, list[str]]:
    """Component -> nodes: inference on the first nodes, the trainer on the rest (one torchrun agent per
    node), the warm-up (one process) and the orchestrator on the trainer's first node; on one node
    everything shares it."""
    if len(hosts) != dep.nodes:
        raise PlacementError(
            f"the job has {len(hosts)} node(s) ({','.join(hosts)}) but deployment.nodes={dep.nodes}: "
            "ask Slurm for deployment.nodes nodes (the `nodes` job variable of the work pool / deployment)"
        )
    if dep.nodes == 1:
        return {name: [hosts[0]] for name in COMPONENTS}
    inference, trainer = list(hosts[: dep.inference_nodes]), list(hosts[dep.inference_nodes :])
    return {"warmup": trainer[:1], "inference": inference, "orchestrator": trainer[:1], "trainer": trainer}


def srun_prefix(name: str, nodes: Sequence[str], slurm: SlurmJobConfig) -> list[str]:
    """The job step for one component: one task per node, sharing the allocation's CPUs with the
    other steps (--overlap), the whole step killed when one task fails."""
    return [
        "srun",
        f"--job-name=rollflow-{name}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--overlap",
        "--mem=0",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        *slurm.srun_args,
    ]


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (`node[01-04],gpu7`) with `scontrol show hostnames`."""
    out = subprocess.run(
        [require("scontrol"), "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def allocation_nodes(dep: DeploymentConfig, env: Mapping[str, str] = os.environ) -> dict[str, list[str]] | None:
    """Inside a Slurm job: component -> its nodes. Outside one (no SLURM_JOB_ID): None, run locally."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return place(dep, hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")))


def sbatch_options(slurm: SlurmJobConfig, nodes: int, job_name: str, output: str) -> list[str]:
    opts = [f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    opts += [f"--cpus-per-task={slurm.cpus_per_task}", f"--mem={slurm.mem}", f"--time={slurm.time_limit}"]
    for key in ("partition", "account", "qos"):
        if getattr(slurm, key):
            opts.append(f"--{key}={getattr(slurm, key)}")
    if slurm.gpus_per_node:
        opts.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.signal_before_s:
        opts.append(f"--signal=B:USR1@{slurm.signal_before_s}")
    return [*opts, f"--output={output}", *slurm.extra_sbatch]


# The flow runs in the background so that the shell can take Slurm's USR1 (a trap does not run while
# bash waits for a foreground child); `wait` returns early on a trapped signal, hence the loop.
_RUN = """\
export {env_name}="${{TMPDIR:-/tmp}}/rollflow-walltime-$SLURM_JOB_ID"
export {grace_name}={grace}
rm -f "${env_name}"
trap 'echo "rollflow: Slurm walltime warning (USR1)"; touch "${env_name}"' USR1
{command} &
child=$!
while true; do
    wait "$child"; rc=$?
    kill -0 "$child" 2>/dev/null || break
done
rm -f "${env_name}"
exit "$rc"
"""


def render_sbatch(
    slurm: SlurmJobConfig, nodes: int, job_name: str, command: str, env: Mapping[str, str], output: str
) -> str:
    """The whole batch script: #SBATCH options, exported environment, setup lines, the flow command."""
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(slurm, nodes, job_name, output))]
    lines.append("# rendered by rollflow (tasks/slurm.py); one job per run, components are srun steps")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += slurm.setup
    run = _RUN.format(
        env_name=WALLTIME_FILE_ENV, grace_name=WALLTIME_GRACE_ENV, grace=slurm.signal_before_s // 2, command=command
    )
    lines.append(run.rstrip("\n"))
    return "\n".join(lines) + "\n"


def render_placement(dep: DeploymentConfig, parallel: ParallelConfig, hosts: Sequence[str] | None = None) -> dict:
    """The placement as --dry-run shows it; without real hosts, nodes are named by index ($node0...). The
    trainer's entry also shows its launcher (torchrun's arguments, run on each of its nodes)."""
    hosts = list(hosts) if hosts else [f"$node{i}" for i in range(dep.nodes)]
    nodes = place(dep, hosts)
    out = {name: {"nodes": nodes[name], "srun": srun_prefix(name, nodes[name], dep.slurm)} for name in COMPONENTS}
    out["trainer"]["launcher"] = torchrun_args(parallel.world_size, nodes["trainer"], parallel.rdzv_port)
    return out


def submit(script_path: str, cwd: str | None = None) -> str:
    """sbatch the script; returns the job id. Raises SbatchRejected with Slurm's message."""
    proc = subprocess.run([require("sbatch"), "--parsable", script_path], capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise SbatchRejected((proc.stderr or proc.stdout).strip() or f"sbatch exited with code {proc.returncode}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, reason/exit code) of a job, from squeue while it is queued or running, then scontrol
    (until MinJobAge), then sacct where accounting is on; (None, None) when Slurm has forgotten it."""
    out = subprocess.run([require("squeue"), "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        state, _, reason = out.stdout.strip().partition("|")
        return state, None if reason in ("None", "") else reason
    out = subprocess.run([require("scontrol"), "show", "job", job_id], capture_output=True, text=True)
    m = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", out.stdout, re.S)
    if out.returncode == 0 and m:
        return m.group(1), f"exit code {m.group(2)}"
    if shutil.which("sacct"):
        argv = ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            state, _, code = out.stdout.strip().splitlines()[0].partition("|")
            return state.split()[0], f"exit code {code}"
    return None, None


def steps(job_id: str) -> list[str]:
    """Names of the job's running steps (squeue -s), e.g. ['batch', 'rollflow-inference', ...]."""
    out = subprocess.run([require("squeue"), "-h", "-s", "-j", job_id, "-o", "%j"], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def cancel(job_id: str) -> None:
    subprocess.run([require("scancel"), job_id], capture_output=True, text=True, check=False)


ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}
# Pending reasons that no amount of waiting resolves: the request exceeds what the partition allows.
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidQOS"}
