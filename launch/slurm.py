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
from config.script_text import (
    ENV_VALUE,
    FLOW_RUN_NAME,
    OPTION_VALUE,
    PATH_TEXT,
    SLURM_NAME,
    Charset,
    check,
    check_env_key,
    check_sbatch_option,
)
from config.trainer_parallel import TrainerParallelConfig
from launch.torchrun import torchrun_args

COMPONENTS = ("warmup", "inference", "orchestrator", "trainer")
# Slurm's walltime warning reaches the batch shell (sbatch --signal=B:USR1@N); the shell turns it into
# this file (in a private directory, see _RUN), which the flow watches: the flow itself may run under a
# Prefect runner that USR1 would kill.
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


def _value(value: object, charset: Charset = PATH_TEXT) -> str:
    """A value as one token of the script: checked (the last guard, whatever the caller validated) and
    quoted. sbatch reads shell-style quotes in #SBATCH lines too; a newline would end the line in both."""
    return shlex.quote(check(str(value), charset))


def _option(line: str) -> str:
    name, sep, value = check_sbatch_option(line).partition("=")
    return name + sep + (_value(value, OPTION_VALUE) if sep else "")


def sbatch_options(slurm: SlurmJobConfig, nodes: int, job_name: str, output: str) -> list[str]:
    opts = [f"--job-name={_value(job_name, FLOW_RUN_NAME)}", f"--nodes={int(nodes)}", "--ntasks-per-node=1"]
    opts += [f"--cpus-per-task={int(slurm.cpus_per_task)}", f"--mem={_value(slurm.mem, SLURM_NAME)}"]
    opts.append(f"--time={_value(slurm.time_limit, OPTION_VALUE)}")
    for key in ("partition", "account", "qos"):
        if getattr(slurm, key):
            opts.append(f"--{key}={_value(getattr(slurm, key), SLURM_NAME)}")
    if slurm.gpus_per_node:
        opts.append(f"--gpus-per-node={int(slurm.gpus_per_node)}")
    if slurm.signal_before_s:
        opts.append(f"--signal=B:USR1@{int(slurm.signal_before_s)}")
    return [*opts, f"--output={_value(output)}", *(_option(line) for line in slurm.extra_sbatch)]


# The walltime flag lives in a directory the job makes for itself (mktemp -d: mode 0700, a random name):
# at a fixed path in a shared /tmp any local user could create it and stop the run. runtime/walltime.py
# also checks that the directory and the flag are the job user's own.
# The flow runs in the background so that the shell can take Slurm's USR1 (a trap does not run while
# bash waits for a foreground child); `wait` returns early on a trapped signal, hence the loop.
_RUN = """\
rollflow_flag_dir=$(mktemp -d "${{TMPDIR:-/tmp}}/rollflow-walltime.XXXXXXXXXX") || exit 1
export {env_name}="$rollflow_flag_dir/flag"
export {grace_name}={grace}
trap 'echo "rollflow: Slurm walltime warning (USR1)"; touch "${env_name}"' USR1
{command} &
child=$!
while true; do
    wait "$child"; rc=$?
    kill -0 "$child" 2>/dev/null || break
done
rm -rf "$rollflow_flag_dir"
exit "$rc"
"""


def render_sbatch(
    slurm: SlurmJobConfig, nodes: int, job_name: str, command: str, env: Mapping[str, str], output: str
) -> str:
    """The whole batch script: #SBATCH options, exported environment, setup lines, the flow command.
    Every value is checked and quoted here (config/script_text.py); `setup` and `command` are shell."""
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(slurm, nodes, job_name, output))]
    lines.append("# rendered by rollflow (launch/slurm.py); one job per run, components are srun steps")
    lines += [f"export {check_env_key(k)}={_value(v, ENV_VALUE)}" for k, v in sorted(env.items())]
    lines += slurm.setup
    grace = int(slurm.signal_before_s) // 2
    run = _RUN.format(env_name=WALLTIME_FILE_ENV, grace_name=WALLTIME_GRACE_ENV, grace=grace, command=command)
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
