"""`python -m engines.trainer.torchrun ARGS` = `python -m torch.distributed.run ARGS`, relaying SIGUSR1.

The flow signals the trainer's process group; torchrun starts each rank in a session of its own, so the
signal reaches only this agent, which has no handler for SIGUSR1 and would die of it. Here the agent
passes it on to its children, the ranks (engines/trainer/rl.py: checkpoint after this step). The ranks in
turn die with the agent (engines/trainer/parallel.py), so killing the group leaves no rank behind.
"""

import contextlib
import os
import signal

from torch.distributed.run import main


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _relay(signum, _frame) -> None:
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _relay)
    main()
