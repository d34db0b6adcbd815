"""Pure renderers of what runs where, from the config alone: the sbatch script, srun steps and component
placement (slurm.py), the trainer's torchrun launcher (torchrun.py), and vLLM servers and routers
(vllm.py). No I/O beyond the return value; `--dry-run` writes what they render."""
