"""A shared deployment and its tenants on disk, for the shared trainer's tests (engines/trainer/shared.py).

`deployment(D)`: a tiny backbone's version 0 published in D (a warm-up's publication: random init, seeded),
deployment.json and config/shared_trainer.json. `tenant(D, T, ...)`: T laid out as a tenant flow leaves it
(version 0 copied from D, config/trainer.json with [model.lora]), `step` rollout steps committed there, and its
record in D/tenants/. Rollout rows: groups of 4 samples of random prompt/completion tokens with the sampler
logprobs and group-normalised advantages an orchestrator would commit (storage/rollouts.py's schema); what the
trainer does with them is the real code path, which is what these tests compare.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from config.model import LoRAConfig, ModelConfig
from config.process import ComponentPaths, SharedTrainerProcessConfig, TrainerProcessConfig
from config.storage import StorageConfig
from config.tenant import DeploymentRecord, SharedConfig, TenantRecord
from config.tracking import TrackingConfig
from config.trainer import CheckpointConfig, TrainerConfig
from engines.models import modeldir
from storage import rollouts, weights
from storage.fs import Storage, get_fs, read_manifest, write_json
from storage.tenants import write_deployment, write_tenant

BACKBONE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_seq_len=32)
VOCAB = modeldir.load(BACKBONE, pretrained=False).tokenizer.vocab_size
GROUP = 4


def deployment(d: Path, poll_s: float = 0.1, max_tenants: int = 4) -> Path:
    """Publish the backbone as D's version 0 and write deployment.json and config/shared_trainer.json."""
    torch.manual_seed(0)
    loaded = modeldir.load(BACKBONE, pretrained=False)
    fs, root = Storage(StorageConfig()).open(str(d))
    weights.Publisher(fs, root).publish(0, loaded.model.publishable_state_dict(), loaded.publication_files())
    sha = read_manifest(fs, weights.version_dir(root, 0))["model_sha256"]
    write_deployment(
        str(d),
        DeploymentRecord(
            backbone_dir=weights.version_dir(root, 0),
            backbone_sha256=sha,
            inference_url="http://127.0.0.1:9",
            max_tenants=max_tenants,
            max_lora_rank=16,
        ),
    )
    cfg = SharedTrainerProcessConfig(
        run=ComponentPaths(output_dir=str(d), run_id="deploy", storage=StorageConfig()),
        model=BACKBONE,
        trainer=TrainerConfig(num_threads=1),
        seed=0,
        deploy_dir=str(d),
        shared=SharedConfig(max_tenants=max_tenants, max_lora_rank=16, poll_s=poll_s),
    )
    write_json(fs, str(d / "config" / "shared_trainer.json"), cfg.model_dump(mode="json"))
    return d / "config" / "shared_trainer.json"


def trainer_config(t: Path, lora: LoRAConfig, seed: int, max_steps: int, resume_step: int | None = None):
    return TrainerProcessConfig(
        run=ComponentPaths(output_dir=str(t), run_id=f"run-{t.name}", storage=StorageConfig()),
        model=BACKBONE.model_copy(update={"lora": lora}),
        trainer=TrainerConfig(micro_batch_size=4, num_threads=1),
        tracking=TrackingConfig(),
        mlflow_run_id=None,
        checkpoint=CheckpointConfig(interval=2),
        resume_step=resume_step,
        seed=seed,
        max_steps=max_steps,
        max_off_policy_steps=2,
    )


def tenant(
    d: Path,
    t: Path,
    lora: LoRAConfig,
    seed: int,
    steps: int,
    max_steps: int,
    attempt: int = 0,
    weight: float = 1.0,
    record: bool = True,
) -> TrainerProcessConfig:
    """T as its flow leaves it, rollout steps 1..`steps` committed, and (with `record`) its record in D."""
    if not (t / "weights" / "step=000000").exists():
        shutil.copytree(d / "weights" / "step=000000", t / "weights" / "step=000000")
    cfg = trainer_config(t, lora, seed, max_steps)
    fs, root = get_fs(str(t))
    write_json(fs, str(t / "config" / "trainer.json"), cfg.model_dump(mode="json"))
    for step in range(1, steps + 1):
        commit_rollouts(t, step, seed)
    if record:
        write_tenant(str(d), tenant_record(t, attempt, weight))
    return cfg


def tenant_record(t: Path, attempt: int = 0, weight: float = 1.0, resume_step: int | None = None) -> TenantRecord:
    return TenantRecord(
        name=t.name,
        output_dir=str(t),
        attempt=attempt,
        run_id=f"run-{t.name}",
        resume_step=resume_step,
        token_sha256=hashlib.sha256(t.name.encode()).hexdigest(),
        weight=weight,
    )


def commit_rollouts(t: Path, step: int, seed: int, groups: int = 2) -> None:
    g = torch.Generator().manual_seed(1000 * seed + step)
    rows = []
    for gi in range(groups):
        group_id = rollouts.group_id(step, gi)
        rewards = torch.rand(GROUP, generator=g)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k in range(GROUP):
            prompt = torch.randint(4, VOCAB, (6,), generator=g).tolist()
            completion = torch.randint(4, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            rows.append(
                {
                    "run_id": f"run-{t.name}",
                    "step": step,
                    "sample_id": rollouts.sample_id(group_id, k),
                    "group_id": group_id,
                    "env": "reverse-text",
                    "policy_version": max(step - 1, 0),
                    "policy_version_end": max(step - 1, 0),
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "completion_logprobs": (-5.0 + 0.1 * torch.randn(len(completion), generator=g)).tolist(),
                    "reward": float(rewards[k]),
                    "advantage": float(advantages[k]),
                    "temperature": 1.0,
                    "finish_reason": "length",
                    "prompt_text": "p",
                    "completion_text": "c",
                }
            )
    fs, root = get_fs(str(t))
    rollouts.write_step(fs, root, step, rollouts.to_table(rows), {"gen_s": 0.1, "dropped": 0})
