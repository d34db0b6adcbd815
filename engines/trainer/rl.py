"""The RL loop: wait for step N's committed shards, train on them, publish policy version N.

Data flow per step: `rollouts/step=N/` (checksum-verified) -> `Batch` -> optional mismatch_kl
measurement -> micro-batched loss/backward -> optimizer step -> `weights/step=N/` -> metrics.
"""

from __future__ import annotations

import signal
import threading
import time

import torch

from config.process import TrainerProcessConfig
from config.tracking import resolve_tracking_uri
from engines.models import lora, modeldir
from engines.trainer import checkpoint, context_parallel, distributed, parallel
from engines.trainer.batch import Batch, PackedBatch, make_batch, micro_batches, pack_batch
from engines.trainer.common import log, routing_for, scored_tokens, seed_everything
from engines.trainer.loss import policy_loss
from engines.trainer.mismatch import Mismatch, PolicyHistory
from engines.trainer.tracking import Tracker
from storage import retention, rollouts, weights
from storage.fs import Storage, is_committed
from storage.rollouts import staleness

# Set by SIGUSR1, which the flow relays when Slurm's walltime warning arrives: checkpoint after this step.
CHECKPOINT_NOW = threading.Event()


def _scoring(mb: Batch | PackedBatch) -> torch.Tensor:
    """[rows, T] 1.0 at input positions whose logits score a completion token (aligned with `routes`)."""
    if isinstance(mb, PackedBatch):
        return mb.loss_mask
    return torch.nn.functional.pad(mb.loss_mask, (0, 1))


class RLTrainer:
    def __init__(self, cfg: TrainerProcessConfig):
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.dist = distributed.init(self.tcfg.parallel)  # torchrun ranks; a plain Dist for one process
        seed_everything(cfg.seed, self.tcfg.num_threads)
        self.fs, self.root = Storage(cfg.run.storage).open(cfg.run.output_dir)
        self.publisher = weights.Publisher(self.fs, self.root)
        loaded = modeldir.load(cfg.model, pretrained=False)  # version 0 or a checkpoint is loaded next
        self.tok, self.model = loaded.tokenizer, loaded.model
        self.lora = cfg.model.lora
        if lora.attach_to(self.model, self.lora, train=True):
            trainable, total = lora.trainable_fraction(self.model)
            log.info(f"LoRA: {trainable} of {total} parameters train ({trainable / total:.2%})")
        self.publication_files = loaded.publication_files()  # config.json, tokenizer: same every version
        self.version = self._load_weights()
        self.history = self._build_history() if self.tcfg.measure_mismatch and self.dist.is_main else None
        parallel.parallelize(self.model, self.dist, self.tcfg.parallel, loaded.source.impl)
        self.optimizer, self.scheduler = self._build_optimizer()
        parts: dict[str, checkpoint.Stateful] = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "rng": checkpoint.RNGState(),
        }
        if self.lora:
            parts["lora"] = lora.AdapterPart(self.model)  # the base is saved as the weights
        self.state = checkpoint.TrainerState(
            self.model,
            parts,
            cfg.mlflow_run_id,
            cfg.seed,
            self.publication_files,
        )
        if cfg.resume_step is not None:
            checkpoint.restore(self.fs, self.root, cfg.resume_step, self.state, self.dist)
            log.info(f"resumed from checkpoint step={cfg.resume_step}")
        # the flow's URI: trainer.json holds it redacted, MLFLOW_TRACKING_URI in full (config/tracking.py)
        uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.run.output_dir) if cfg.mlflow_run_id else None
        self.tracker = Tracker(self.fs, self.root, uri, cfg.mlflow_run_id)
        self.sender = None
        if cfg.weight_broadcast.type == "collective" and self.dist.is_main:  # rank 0 holds the gathered weights
            from engines.weight_transport import Sender

            self.sender = Sender(cfg.weight_broadcast)

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        o = self.tcfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        warmup = o.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1)))
        return optimizer, scheduler

    def _load_weights(self) -> int:
        """Weights of the checkpoint the flow chose, or the warm-up's version 0; returns the version."""
        step = self.cfg.resume_step
        if step is not None:
            checkpoint.restore_weights(self.fs, self.root, step, self.model)
            return step
        if not is_committed(self.fs, weights.version_dir(self.root, 0)):
            raise SystemExit("no committed weights to start from; the warm-up publishes version 0")
        self.model.load_published(weights.load(self.fs, weights.version_dir(self.root, 0)))
        return 0

    def _build_history(self) -> PolicyHistory:
        """Recent policies for mismatch_kl: the current one plus the publications just before it."""
        keep = self.cfg.max_off_policy_steps + 1
        history = PolicyHistory(self.model, keep)
        for v in range(max(0, self.version - keep + 1), self.version):
            if is_committed(self.fs, weights.version_dir(self.root, v)):
                history.add_state(v, weights.load(self.fs, weights.version_dir(self.root, v)))
        history.add(self.version, self.model)
        return history

    def wait_for_rollouts(self, step: int):
        directory = rollouts.step_path(self.root, step)
        while not is_committed(self.fs, directory):
            time.sleep(0.05)
        return rollouts.read_step(self.fs, self.root, step)

    def train_micro_batches(self, batch: Batch) -> list[Batch] | list[PackedBatch]:
        """`micro_batch_size` rows each; with `trainer.packing` a row holds several samples."""
        if self.tcfg.packing:
            return micro_batches(pack_batch(batch, self.tok.pad_id), self.tcfg.micro_batch_size)
        return micro_batches(batch, self.tcfg.micro_batch_size)

    def train_on(self, batch: Batch, n_tokens: float | None = None, weight: float = 1.0) -> dict:
        """One optimizer step on `batch` (under torchrun: this rank's share, `n_tokens` the whole step's count,
        `weight` 0 for a rank whose share is a stand-in row)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = n_tokens or float(batch.loss_mask.sum().clamp(min=1))
        loss_sum = masked = kl_sum = nonfinite = replayed = support_mismatch = 0.0
        lc = self.tcfg.loss
        for full, w in distributed.even_micro_batches(self.train_micro_batches(batch), weight, self.dist):
            mb = context_parallel.shard(full, self.dist)  # with cp: this rank's tokens of every row
            routing = routing_for(mb, self.tcfg.enable_router_replay)
            if routing is not None and routing.replay is not None:
                replayed += float(((routing.replay[..., 0, 0] >= 0) & (_scoring(mb) > 0)).sum())
            with context_parallel.gathered_kv(self.dist):
                scored = scored_tokens(self.model, mb, routing)  # on the sampler's kept support, if recorded
            logprobs = scored.logprobs
            out = policy_loss(
                logprobs,
                mb.sampler_logprobs,
                mb.advantages,
                mb.loss_mask,
                lc.mask_low,
                lc.mask_high,
                n_tokens,
            )
            (out.loss * w).backward()  # w = 0: a stand-in that keeps the ranks' collectives in step
            if not w:
                continue
            loss_sum += float(out.loss.detach())
            masked += out.masked_tokens
            kl_sum += out.sampler_kl_sum
            nonfinite += out.nonfinite_tokens
            support_mismatch += scored.support_mismatch_tokens
        grad_norm = parallel.clip_grad_norm(self.model, self.tcfg.optim.max_grad_norm, self.dist)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.model.eval()
        loss_sum, masked, kl_sum, nonfinite, replayed, support_mismatch = distributed.all_reduce(
            [loss_sum, masked, kl_sum, nonfinite, replayed, support_mismatch], self.dist
        )
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": lr,
            "masked_fraction": masked / n_tokens,
            "sampler_kl": kl_sum / n_tokens,
            "sampler_nonfinite_tokens": int(nonfinite),
            "tokens": int(n_tokens),
            # completion tokens scored through the sampler's experts (router replay); 0 without replay
            "replayed_fraction": replayed / n_tokens,
            # kept-support tokens the trainer ranks outside its own top k (docs/algorithm.md "Keep sampling mask")
            "support_mismatch_tokens": int(support_mismatch),
        }

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        table, manifest = self.wait_for_rollouts(step)
        t1 = time.perf_counter()
        batch = make_batch(table, self.tok.pad_id, self.tcfg.keep_sampling_mask)
        pack_pad = self.tok.pad_id if self.tcfg.packing else None
        mismatch = (
            self.history.mismatch_kl(batch, self.tcfg.micro_batch_size, pack_pad, self.tcfg.enable_router_replay)
            if self.history
            else Mismatch(None, 0, None)
        )
        share, weight = distributed.local_share(batch, self.dist)
        stats = self.train_on(share, float(batch.loss_mask.sum().clamp(min=1)), weight)
        t2 = time.perf_counter()
        published = parallel.full_state_dict(self.model, self.dist)  # a collective; rank 0 keeps the weights
        broadcast_s = None
        if self.dist.is_main:
            # collective transport first: the engine has the tensors before the orchestrator sees the commit
            broadcast_s = self.sender.send(step, published) if self.sender else None
            self.publish(step, published)
            retention.enforce(self.fs, self.root, bases=self.publisher.bases)  # a no-op unless storage.keep_last_*
        self.version = step
        if self.history and self.dist.enabled:
            self.history.add_state(step, published)
        elif self.history:
            self.history.add(step, self.model)
        t3 = time.perf_counter()
        stale = [staleness(step, v) for v in table.column("policy_version").to_pylist()]
        rewards = table.column("reward").to_pylist()
        return {
            "step": step,
            "time": time.time(),
            "reward_mean": sum(rewards) / len(rewards),
            "mismatch_kl": mismatch.kl,
            "mismatch_tokens": mismatch.tokens,
            "expert_mismatch": mismatch.expert_mismatch,
            **stats,
            "samples": len(rewards),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            "completion_len_mean": stats["tokens"] / len(rewards),
            "wait_s": t1 - t0,
            "train_s": t2 - t1,
            "publish_s": t3 - t2,
            "broadcast_s": broadcast_s,
            "step_s": t3 - t0,
            "gen_s": manifest.get("gen_s"),
            **rollouts.metric_means(table),
        }

    def publish(self, step: int, published: dict[str, torch.Tensor]) -> None:
        """Policy version `step`: the full weights (`published`, gathered on rank 0), or with LoRA the adapters
        on version 0 (LoRA runs on one trainer process: config/run.py)."""
        if self.lora:
            lora.publish(self.publisher, self.model, self.lora, step, self.publication_files)
        else:
            self.publisher.publish(step, published, self.publication_files)

    def run(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: CHECKPOINT_NOW.set())
        for step in range(self.version + 1, self.cfg.max_steps + 1):
            row = self.step(step)
            if self.dist.is_main:
                self._report(step, row)
            # every rank must checkpoint at the same step: SIGUSR1 may reach them a step apart
            nudged = distributed.all_reduce([float(CHECKPOINT_NOW.is_set())], self.dist, "max")[0]
            if step % self.cfg.checkpoint.interval == 0 or step == self.cfg.max_steps or nudged:
                CHECKPOINT_NOW.clear()
                written = checkpoint.save(self.fs, self.root, step, self.state, self.dist)
                if self.dist.is_main:
                    log.info(f"checkpoint written: {written}")
                    retention.enforce(self.fs, self.root, bases=self.publisher.bases)
        distributed.shutdown(self.dist)

    def _report(self, step: int, row: dict) -> None:
        self.tracker.record(row)
        kl = "n/a" if row["mismatch_kl"] is None else f"{row['mismatch_kl']:.1e}"
        log.info(
            f"step {step}/{self.cfg.max_steps} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f} "
            f"| mismatch_kl {kl} | staleness {row['staleness_mean']:.2f} | masked {row['masked_fraction']:.3f} "
            f"| train {row['train_s']:.2f}s wait {row['wait_s']:.2f}s"
        )
