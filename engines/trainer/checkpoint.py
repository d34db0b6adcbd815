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
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import torch

from storage import checkpoints, rollouts


class Stateful(Protocol):
    """What a checkpoint holds of a part: torch's optimizer and scheduler already are one."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """The process's torch and Python RNGs as a checkpointable part."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])


@dataclass
class TrainerState:
    """Everything a trainer checkpoint saves: the model's weights, the stateful parts by name, and the run."""

    model: Any  # CausalLM: saved as its publishable state dict (safetensors)
    parts: dict[str, Stateful]  # e.g. optimizer, scheduler, rng
    mlflow_run_id: str | None  # the run's MLflow run, kept so a resume reopens it
    seed: int
    files: dict[str, bytes] = field(default_factory=dict)  # config.json, tokenizer: saved beside the weights


def save(fs: fsspec.AbstractFileSystem, root: str, step: int, state: TrainerState) -> str:
    """Commit trainer `step`'s checkpoint; returns its directory."""
    from safetensors.torch import save as st_save

    buf = io.BytesIO()
    torch.save({"step": step, **{name: part.state_dict() for name, part in state.parts.items()}}, buf)
    committed = rollouts.committed_rollout_steps(fs, root)
    run_state = {
        "step": step,
        "mlflow_run_id": state.mlflow_run_id,
        "committed_rollout_steps": committed,
        # Prompts and sampling seeds are pure functions of (seed, step, group): the cursor is the
        # orchestrator's whole state. MoE routing payloads live in the committed shards listed above.
        "orchestrator": {"prompt_cursor": (committed[-1] + 1) if committed else 1, "seed": state.seed},
    }
    files = {
        "model.safetensors": st_save(state.model.publishable_state_dict()),
        "trainer_state.pt": buf.getvalue(),
        "run_state.json": json.dumps(run_state, indent=1).encode(),
        **state.files,
    }
    return checkpoints.save(fs, root, step, "trainer", files)


def restore(fs: fsspec.AbstractFileSystem, root: str, step: int, state: TrainerState) -> None:
    """Load checkpoint `step` (checksum-verified) into the model and every part."""
    from safetensors.torch import load as st_load

    files = checkpoints.load(fs, root, step, "trainer")
    state.model.load_published(st_load(files["model.safetensors"]))
    saved = torch.load(io.BytesIO(files["trainer_state.pt"]), weights_only=True)
    if saved["step"] != step:
        raise RuntimeError(f"checkpoint step={step} holds trainer state for step {saved['step']}")
    if "rng" not in saved and "torch_rng" in saved:  # checkpoints written before parts had names
        saved["rng"] = {"torch": saved["torch_rng"], "python": saved["python_rng"]}
    for name, part in state.parts.items():
        part.load_state_dict(saved[name])
