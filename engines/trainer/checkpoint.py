"""Trainer checkpoints: everything a resumed trainer needs to continue as if never stopped.

`checkpoints/step=N/trainer/` (its file names are defined once, in storage/checkpoints.py) holds the
weights (safetensors, with the publication's config.json and tokenizer files, so it is a Hugging Face
directory too), the optimizer, scheduler and RNG states (`trainer_state.pt`) and `run_state.json`, the
run-level progress at that point: committed rollout steps, where the orchestrator's prompt cursor stands,
and the MLflow run. A manifest with checksums is written last, so a checkpoint is complete or ignored.

The optimizer goes through torch.distributed.checkpoint (DCP, `optimizer/` beside the weights, written by
every rank, keyed by parameter name), so a checkpoint written by N ranks restores on M (engines/trainer/dcp.py).
The weights are the full safetensors rank 0 gathers anyway to publish, loaded before the model is sharded.
Checkpoints from before DCP hold the optimizer inside `trainer_state.pt`; they restore on one process.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import torch

from engines.trainer import dcp, distributed, parallel
from engines.trainer.background import copied
from engines.trainer.distributed import Dist
from storage import checkpoints, rollouts
from storage.fs import read_verified


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


@dataclass
class Captured:
    """What one checkpoint writes, taken from the live state at its step (`capture`)."""

    step: int
    weights: dict[str, torch.Tensor]  # the full publishable weights (rank 0; empty on other ranks)
    optimizer: dict[str, Any]  # this rank's optimizer state, keyed by parameter name (DCP's state dict)
    files: dict[str, bytes]  # the checkpoint's other files, serialised


def capture(
    fs: fsspec.AbstractFileSystem, root: str, step: int, state: TrainerState, d: Dist | None = None, copy: bool = False
) -> Captured:
    """Step `step`'s checkpoint contents (a collective: every rank calls it). `copy`: tensors are copied, so the
    training loop may change the model and optimizer while `write` runs in another thread."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    d = d or Dist()
    weights = parallel.full_state_dict(state.model, d)
    optimizer = get_optimizer_state_dict(state.model, state.parts["optimizer"])  # type: ignore[arg-type]
    if copy:
        weights, optimizer = copied(weights), copied(optimizer)
    if not d.is_main:
        return Captured(step, {}, optimizer, {})
    buf = io.BytesIO()
    kept = {name: part.state_dict() for name, part in state.parts.items() if name != "optimizer"}
    torch.save({"step": step, **kept}, buf)
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
        checkpoints.TRAINER_STATE_FILE: buf.getvalue(),
        checkpoints.RUN_STATE_FILE: json.dumps(run_state, indent=1).encode(),
        **state.files,
    }
    return Captured(step, weights, optimizer, files)


def write(fs: fsspec.AbstractFileSystem, root: str, c: Captured, d: Dist | None = None) -> str | None:
    """Commit a captured checkpoint (a collective); rank 0 returns its directory."""
    from safetensors.torch import save as st_save

    d = d or Dist()
    directory = checkpoints.step_path(root, c.step, checkpoints.TRAINER)
    if d.is_main:
        checkpoints.uncommit(fs, directory)  # rewriting: no reader may pair an old manifest with new files
    distributed.barrier(d)
    written, staged = dcp.save_optimizer(fs, directory, c.optimizer, d)
    if not d.is_main:
        distributed.barrier(d)
        return None
    files = {checkpoints.WEIGHTS_FILE: st_save(c.weights), **c.files, **staged}
    checkpoints.save(fs, root, c.step, checkpoints.TRAINER, files, written)
    distributed.barrier(d)
    return directory


def save(fs: fsspec.AbstractFileSystem, root: str, step: int, state: TrainerState, d: Dist | None = None) -> str | None:
    """Commit trainer `step`'s checkpoint (a collective: every rank calls it); rank 0 returns its directory."""
    return write(fs, root, capture(fs, root, step, state, d), d)


def restore_weights(fs: fsspec.AbstractFileSystem, root: str, step: int, model: Any) -> None:
    """Load checkpoint `step`'s weights (checksum-verified) into the model, before it is sharded."""
    from safetensors.torch import load as st_load

    manifest = checkpoints.manifest(fs, root, step, checkpoints.TRAINER)
    directory = checkpoints.step_path(root, step, checkpoints.TRAINER)
    model.load_published(st_load(read_verified(fs, directory, checkpoints.WEIGHTS_FILE, manifest)))


def restore(fs: fsspec.AbstractFileSystem, root: str, step: int, state: TrainerState, d: Dist | None = None) -> None:
    """Load checkpoint `step`'s parts (checksum-verified); the weights were loaded by `restore_weights`."""
    d = d or Dist()
    manifest = checkpoints.manifest(fs, root, step, checkpoints.TRAINER)
    directory = checkpoints.step_path(root, step, checkpoints.TRAINER)
    saved = torch.load(
        io.BytesIO(read_verified(fs, directory, checkpoints.TRAINER_STATE_FILE, manifest)), weights_only=True
    )
    if saved["step"] != step:
        raise RuntimeError(f"checkpoint step={step} holds trainer state for step {saved['step']}")
    if "rng" not in saved and "torch_rng" in saved:  # checkpoints written before parts had names
        saved["rng"] = {"torch": saved["torch_rng"], "python": saved["python_rng"]}
    for name, part in state.parts.items():
        if name == "optimizer" and "optimizer" not in saved:
            dcp.load_optimizer(fs, directory, manifest, state.model, part, d)
        elif name == "optimizer" and d.enabled:
            raise SystemExit(
                f"{directory}: written by a single-process trainer before DCP checkpoints; resume it once with "
                "trainer.parallel.world_size = 1 (its next checkpoint restores on any number of ranks)"
            )
        else:
            part.load_state_dict(saved[name])
