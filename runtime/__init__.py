"""The run machinery without Prefect, which flows/ and tasks/ call: the run directory (rundir.py), opening
and closing a run (lifecycle.py), the lease (lease.py), process supervision (process.py), Slurm's CLI
(slurm.py) and walltime warning (walltime.py), the end-of-run summary (summary.py) and its curves
(curves.py), the live progress view and its watcher thread (progress.py), MLflow bookkeeping
(tracking.py) and the CLI's temporary local Prefect API server (local_api.py, a subprocess)."""
