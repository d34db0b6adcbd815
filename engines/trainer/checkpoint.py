"""Trainer checkpoints: everything a resumed trainer needs to continue as if never stopped.

`checkpoints/step=N/trainer/` holds the weights (safetensors, with the publication's config.json and
tokenizer files, so it is a Hugging Face directory too), the optimizer, scheduler and RNG states
(`trainer_state.pt`) and `run_state.json`, the run-level progress at that point: committed rollout
steps, where the orchestrator's prompt cursor stands, and the MLflow run. A manifest with checksums is
written last, so a checkpoint is complete or ignored.
"""

from __future__ import annotations

import io
import json
import random

import torch

from storage import checkpoints, rollouts
from storage.fs import get_fs


def save(trainer, step: int) -> str:
    """Commit trainer `step`'s checkpoint; returns its directory."""
    from safetensors.torch import save as st_save

    buf = io.BytesIO()
    state = {
        "step": step,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    torch.save(state, buf)
    committed = rollouts.committed_rollout_steps(trainer.fs, trainer.root)
    run_state = {
        "step": step,
        "mlflow_run_id": trainer.cfg.mlflow_run_id,
        "committed_rollout_steps": committed,
        # Prompts and sampling seeds are pure functions of (seed, step, group): the cursor is the
        # orchestrator's whole state. MoE routing payloads live in the committed shards listed above.
        "orchestrator": {"prompt_cursor": (committed[-1] + 1) if committed else 1, "seed": trainer.cfg.seed},
    }
    files = {
        "model.safetensors": st_save(trainer.model.publishable_state_dict()),
        "trainer_state.pt": buf.getvalue(),
        "run_state.json": json.dumps(run_state, indent=1).encode(),
        **trainer.publication_files,
    }
    return checkpoints.save(trainer.fs, trainer.root, step, "trainer", files)


def restore(trainer, step: int) -> None:
    """Load checkpoint `step` (checksum-verified) into the trainer's model, optimizer and RNGs."""
    from safetensors.torch import load as st_load

    fs, root = get_fs(trainer.cfg.run.output_dir)
    files = checkpoints.load(fs, root, step, "trainer")
    trainer.model.load_published(st_load(files["model.safetensors"]))
    state = torch.load(io.BytesIO(files["trainer_state.pt"]), weights_only=True)
    if state["step"] != step:
        raise RuntimeError(f"checkpoint step={step} holds trainer state for step {state['step']}")
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
