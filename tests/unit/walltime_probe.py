"""The flow of a rendered Slurm job in test_slurm_hostile.py, run by the job's own bash: it plants a
walltime flag where the job script used to put it (a fixed name in the shared $TMPDIR, which any local user
can create), watches as the `rl` flow does, then sends its batch shell USR1 as Slurm does before the time
limit. Prints what it saw as key=value lines."""

from __future__ import annotations

import logging
import os
import signal
import stat

from runtime.walltime import WalltimeWatch


def main() -> None:
    old_path = os.path.join(os.environ["TMPDIR"], f"rollflow-walltime-{os.environ['SLURM_JOB_ID']}")
    open(old_path, "w").close()
    with WalltimeWatch(logging.getLogger("probe"), lambda: [], poll_s=0.02) as watch:
        planted = watch.reached.wait(0.5)
        folder = os.stat(os.path.dirname(watch.path or "."))
        os.kill(os.getppid(), signal.SIGUSR1)  # sbatch --signal=B:USR1 signals the batch shell
        usr1 = watch.reached.wait(10)
    print(f"planted_stops={planted}")
    print(f"dir_mode={stat.S_IMODE(folder.st_mode):o}")
    print(f"dir_uid={folder.st_uid}")
    print(f"usr1_stops={usr1}")
    print(f"odd={os.environ.get('ODD')!r}")
    print(f"empty={os.environ.get('EMPTY')!r}")


if __name__ == "__main__":
    main()
