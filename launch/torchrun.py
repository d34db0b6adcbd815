"""The trainer's launcher argv when it has several ranks: torchrun on one node, or one agent per node.

No Prefect or torch here: `--dry-run` renders it (launch/slurm.py `render_placement`), the `rl` flow puts it
between the interpreter and `-m engines.trainer` (tasks/components.py `run_component`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# What `--dry-run` shows where the flow puts each attempt's own id (`rdzv_id`).
RDZV_ID_PLACEHOLDER = "rollflow-RUN_ID-aATTEMPT"


def rdzv_id(run_id: str, attempt: int) -> str:
    """The rendezvous id of one attempt of one run: agents of another run, or of this run's previous attempt
    still shutting down, that reach the same store (a shared node, the same port) never join this one."""
    return "rollflow-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_id) + f"-a{attempt}"


def torchrun_args(
    world_size: int, nodes: Sequence[str] = (), port: int = 29400, rdzv: str = RDZV_ID_PLACEHOLDER
) -> list[str]:
    """torchrun (`torch.distributed.run`, via engines/trainer/torchrun.py which keeps SIGUSR1 for the ranks)
    with `world_size` ranks: the trainer's launcher when trainer.parallel.world_size > 1; empty for one
    process. On one node `--standalone` rendezvouses on localhost (a free port and a random id, torch's
    own); on several (`nodes`, the trainer's step under Slurm runs this on each) the agents meet at the first
    node's c10d store on `port` under the rendezvous id `rdzv` (the flow's `rdzv_id` per attempt) and start
    world_size / len(nodes) ranks each."""
    if world_size <= 1:
        return []
    base = ["-m", "engines.trainer.torchrun"]
    if len(nodes) <= 1:
        return [*base, "--standalone", "--nproc-per-node", str(world_size)]
    per_node = str(world_size // len(nodes))
    meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0]}:{port}", "--rdzv-id", rdzv]
    return [*base, "--nnodes", str(len(nodes)), "--nproc-per-node", per_node, *meet]
