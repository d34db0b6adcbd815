"""What runs where on Slurm, rendered: the sbatch script, the placement of components on the
allocated nodes, and the `srun` prefix of each component's command. Pure functions of the config.

Data flow: `SlurmPlacementConfig` (the profile's `[deployment]`) -> `render_sbatch` (one job per run;
`rollflow submit`, the Slurm worker, `--dry-run`) -> inside the job the flow expands the allocation
(runtime/slurm.py `allocation_nodes`) -> `place` -> per-component node lists -> `srun_prefix` put in front
of each component's command by `tasks.components`. Talking to Slurm itself (sbatch, squeue, ...) is
runtime/slurm.py's.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from config.placement import SlurmJobConfig, SlurmPlacementConfig
from config.trainer_parallel import TrainerParallelConfig
from launch.torchrun import torchrun_args

COMPONENTS = ("warmup", "inference", "orchestrator", "trainer")
# Slurm's walltime warning reaches the batch shell (sbatch --signal=B:USR1@N); the shell turns it into
# this file, which the flow watches: the flow itself may run under a Prefect runner that USR1 would kill.
WALLTIME_FILE_ENV = "ROLLFLOW_WALLTIME_FILE"
WALLTIME_GRACE_ENV = "ROLLFLOW_WALLTIME_GRACE_S"  # how long the flow waits for a checkpoint after it


class PlacementError(RuntimeError):
    """The allocation does not match the profile's deployment section."""


def place(dep: SlurmPlacementConfig, hosts: Sequence[str]) -> dict[str, list[str]]:
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
    lines.append("# rendered by rollflow (launch/slurm.py); one job per run, components are srun steps")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += slurm.setup
    run = _RUN.format(
        env_name=WALLTIME_FILE_ENV, grace_name=WALLTIME_GRACE_ENV, grace=slurm.signal_before_s // 2, command=command
    )
    lines.append(run.rstrip("\n"))
    return "\n".join(lines) + "\n"


def teacher_nodes(nodes: Mapping[str, list[str]]) -> list[str]:
    """Where a distillation teacher's server runs ([teacher]): beside the first inference server."""
    return nodes["inference"][:1]


def render_placement(
    dep: SlurmPlacementConfig,
    parallel: TrainerParallelConfig,
    hosts: Sequence[str] | None = None,
    teacher: bool = False,
) -> dict:
    """The placement as --dry-run shows it; without real hosts, nodes are named by index ($node0...). The
    trainer's entry also shows its launcher (torchrun's arguments, run on each of its nodes); with `teacher`,
    the distillation teacher's server has an entry too."""
    hosts = list(hosts) if hosts else [f"$node{i}" for i in range(dep.nodes)]
    nodes = place(dep, hosts)
    if teacher:
        nodes = {**nodes, "teacher": teacher_nodes(nodes)}
    out = {name: {"nodes": n, "srun": srun_prefix(name, n, dep.slurm)} for name, n in nodes.items()}
    out["trainer"]["launcher"] = torchrun_args(parallel.world_size, nodes["trainer"], parallel.rdzv_port)
    return out
