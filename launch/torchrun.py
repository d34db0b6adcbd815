"""The trainer's launcher argv when it has several ranks: torchrun on one node, or one agent per node.

No Prefect or torch here: `--dry-run` renders it (launch/slurm.py `render_placement`), the `rl` flow puts it
between the interpreter and `-m engines.trainer` (tasks/components.py `run_component`).
"""

from __future__ import annotations

from collections.abc import Sequence


def torchrun_args(world_size: int, nodes: Sequence[str] = (), port: int = 29400) -> list[str]:
    """torchrun (`torch.distributed.run`, via engines/trainer/torchrun.py which keeps SIGUSR1 for the ranks)
    with `world_size` ranks: the trainer's launcher when trainer.parallel.world_size > 1; empty for one
    process. On one node `--standalone` rendezvouses on localhost; on several (`nodes`, the trainer's step
    under Slurm runs this on each) the agents meet at the first node's c10d store on `port` and start
    world_size / len(nodes) ranks each."""
    if world_size <= 1:
        return []
    base = ["-m", "engines.trainer.torchrun"]
    if len(nodes) <= 1:
        return [*base, "--standalone", "--nproc-per-node", str(world_size)]
    per_node = str(world_size // len(nodes))
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0]}:{port}", "--rdzv-id", "rollflow-trainer"]
    return [*base, "--nnodes", str(len(nodes)), "--nproc-per-node", per_node, *rdzv]
