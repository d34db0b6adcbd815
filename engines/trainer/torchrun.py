"""`python -m engines.trainer.torchrun ARGS` = `python -m torch.distributed.run ARGS`, deaf to SIGUSR1.

The flow relays Slurm's walltime warning as SIGUSR1 to the trainer's whole process group; torchrun's
agent has no handler for it and would die of it, taking the ranks along. Here the agent ignores it; each
rank installs its own handler (engines/trainer/rl.py: checkpoint after this step), which replaces the
inherited 'ignore'.
"""

import signal

from torch.distributed.run import main

if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    main()
