"""One tenant of the shared trainer (engines/trainer/shared.py): the standalone `RLTrainer` on the tenant's own
OUTPUT_DIR, with the deployment's backbone in place of a model of its own.

    TenantRecord -> <OUTPUT_DIR>/config/trainer.json (validated: `tenant_config`) -> `TenantTrainer`
    = RLTrainer whose model is a copy of the backbone module tree that shares every backbone parameter and
      buffer (`share_backbone`), with the tenant's adapters attached to the copy

so a tenant holds only its adapters, their optimizer and scheduler, its RNG state and its metrics; its rollouts,
publications, checkpoints and metrics.jsonl stay in its own OUTPUT_DIR, exactly where a standalone trainer puts
them. Exactness with a standalone trainer on the same rollouts: the adapters' initial values come from the same
RNG draws (the standalone model's random init is replayed, then discarded), and the process-global RNG is
swapped in and out around each of the tenant's steps (`train_once`), so other tenants' steps between two of
its own draw nothing from its stream. What a tenant cannot have here (it would need a second backbone copy, a
second process or a second rank): the mismatch history (mismatch_kl is not measured: it never changes the
update), a KL reference, collective weight broadcast, torchrun ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
import time

from torch import nn

from config.model import ModelConfig
from config.process import TrainerProcessConfig
from config.tenant import SharedConfig, TenantRecord
from config.tracking import resolve_tracking_uri
from engines.models import modeldir
from engines.trainer import checkpoint
from engines.trainer.rl import RLTrainer
from storage import weights
from storage.fs import is_committed, join, read_json, read_manifest


class TenantRefused(ValueError):
    """A tenant the shared trainer cannot train (its record or config); the reason goes to its status file."""


def share_backbone(backbone: nn.Module) -> nn.Module:
    """A copy of `backbone`'s module tree whose parameters and buffers are the backbone's own tensors (a
    deepcopy memo mapping each to itself): modules and their flags are per tenant, the weights are not."""
    memo: dict[int, object] = {id(t): t for t in itertools.chain(backbone.parameters(), backbone.buffers())}
    return copy.deepcopy(backbone, memo)


def tenant_config(record: TenantRecord, backbone: ModelConfig, shared: SharedConfig) -> TrainerProcessConfig:
    """The tenant's trainer slice from its OUTPUT_DIR, checked against its record and the deployment."""
    path = join(record.output_dir, "config", "trainer.json")
    try:
        cfg = TrainerProcessConfig.model_validate(read_json(path))
    except (OSError, ValueError) as exc:  # a missing file, bad JSON, a config that does not validate
        raise TenantRefused(f"{path}: {str(exc).splitlines()[0]}") from exc
    lora = cfg.model.lora
    problems = []
    if cfg.run.output_dir.rstrip("/") != record.output_dir.rstrip("/"):
        problems.append(f"run.output_dir={cfg.run.output_dir!r} is not the record's {record.output_dir!r}")
    if lora is None:
        problems.append("no [model.lora]: a tenant trains adapters only")
    elif lora.rank > shared.max_lora_rank:
        problems.append(f"model.lora.rank={lora.rank} is above the deployment's max_lora_rank={shared.max_lora_rank}")
    differ = _differences(cfg.model.model_copy(update={"lora": None}), backbone)
    if differ:
        problems.append(f"[model] differs from the backbone's in {differ}")
    if cfg.resume_step != record.resume_step:
        problems.append(f"resume_step={cfg.resume_step} but the record's attempt says {record.resume_step}")
    if cfg.trainer.parallel.world_size != 1:
        problems.append("trainer.parallel.world_size must be 1 (the shared trainer is one process)")
    if cfg.weight_broadcast.type != "filesystem":
        problems.append("weight_broadcast.type must be 'filesystem' (the shared server reads publications)")
    if cfg.trainer.reference.enabled:
        problems.append("trainer.reference (a KL reference) would be a second backbone copy per tenant")
    if problems:
        raise TenantRefused(f"{path}: " + "; ".join(problems))
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"measure_mismatch": False})})


def _differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    da, db = a.model_dump(), b.model_dump()
    return sorted(k for k in da.keys() | db.keys() if da.get(k) != db.get(k))


class TenantTrainer(RLTrainer):
    """RLTrainer on a tenant's OUTPUT_DIR, its model sharing `backbone`'s tensors; `train_once` runs one step."""

    def __init__(self, cfg: TrainerProcessConfig, backbone: nn.Module, backbone_sha256: str):
        self._backbone, self._backbone_sha256 = backbone, backbone_sha256
        super().__init__(cfg)
        self.checkpoint_now = threading.Event()  # set by the shared loop's SIGUSR1, for this tenant only
        self.rng = checkpoint.RNGState().state_dict()  # this tenant's RNG stream, between its steps
        self.trainer_s = 0.0

    def _load_model(self) -> modeldir.LoadedModel:
        # the standalone trainer's random init, run for its RNG draws only (freed on return): the adapters
        # attached next draw the numbers a standalone trainer of this config draws
        replayed = modeldir.load(self.cfg.model, pretrained=False)
        return dataclasses.replace(replayed, model=share_backbone(self._backbone))

    def _load_weights(self) -> int:
        """The backbone is version 0 already: check the tenant's version 0 is this backbone, load nothing (a
        checkpoint's base equals version 0, its adapters come back with the checkpoint's `lora` part)."""
        v0 = weights.version_dir(self.root, 0)
        if not is_committed(self.fs, v0):
            raise TenantRefused(f"{v0}: no committed version 0 (the tenant flow copies the backbone there)")
        sha = read_manifest(self.fs, v0).get("model_sha256")
        if sha != self._backbone_sha256:
            raise TenantRefused(f"{v0}: model_sha256 {sha} is not the deployment's backbone {self._backbone_sha256}")
        return self.cfg.resume_step or 0

    def _tracking_uri(self) -> str | None:
        # the tenant's own URI (its config, else the sqlite store in its OUTPUT_DIR), never the deployment's env
        return resolve_tracking_uri(self.cfg.tracking.tracking_uri, self.cfg.run.output_dir, environ={})

    @property
    def next_step(self) -> int:
        return self.version + 1

    @property
    def done(self) -> bool:
        return self.version >= self.cfg.max_steps

    def train_once(self) -> dict:
        """Train `next_step` (its rollouts must be committed: `ready`) with this tenant's RNG stream."""
        rng = checkpoint.RNGState()
        rng.load_state_dict(self.rng)
        t0 = time.perf_counter()
        try:
            return self.train_step(self.next_step)
        finally:
            self.rng = rng.state_dict()
            self.trainer_s += time.perf_counter() - t0

    def final_eval_merged(self) -> bool:
        """Whether the final version's evaluation is merged (or none is expected); merges what has arrived."""
        if self.cfg.eval.interval <= 0:
            return True
        self.evals.merge(self.cfg.max_steps)
        return self.evals.merged(self.cfg.max_steps)
