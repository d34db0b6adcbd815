"""The RL loop: wait for step N's committed shards, train on them, publish policy version N.

Data flow per step: `rollouts/step=N/` (checksum-verified) -> `Batch` -> optional mismatch_kl
measurement -> micro-batched loss/backward -> optimizer step -> `weights/step=N/` -> metrics.

mismatch_kl costs no extra forward for the samples the current weights drew: the proximal scoring, or else the
loss's forward before the step's first optimizer step, scores them with exactly those weights, and adds them
(`Batch.measured`) to the sums the history's forward fills for the other samples (older policies: on a
`trainer.mismatch_sample_fraction` sample of them).
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from config.process import TrainerProcessConfig
from config.tracking import resolve_tracking_uri
from engines.heartbeat import heartbeat
from engines.models import lora, modeldir
from engines.models.decoder import CausalLM
from engines.models.moe import Routing
from engines.models.vlm import is_vision
from engines.trainer import checkpoint, context_parallel, distributed, flops, parallel
from engines.trainer.background import Writes, copied
from engines.trainer.batch import Batch, PackedBatch, make_batch
from engines.trainer.common import Scored, forward_precision, log, routing_for, scored_tokens, seed_everything
from engines.trainer.eval_merge import EvalMerger
from engines.trainer.layout import Layout, TokenCost, forward_tokens
from engines.trainer.losses.objective import MAX_STATS, Objective, StepCounts, step_metrics, token_scores
from engines.trainer.mismatch import Mismatch, MismatchSums, PolicyHistory, stale_sample
from engines.trainer.tracking import Tracker
from storage import retention, rollouts, weights
from storage.fs import Storage, is_committed
from storage.rollouts import staleness

# Set by SIGUSR1, which the flow relays when Slurm's walltime warning arrives: checkpoint after this step.
CHECKPOINT_NOW = threading.Event()
WRITE_TIMEOUT_S = 600.0  # a background write still running then is an error (stall.trainer_s's floor)


@dataclass
class Micro:
    """A micro-batch of this rank with its loss weight, and the logprobs scored once per step for it."""

    mb: Batch | PackedBatch
    weight: float
    proximal: torch.Tensor | None = None
    reference: torch.Tensor | None = None


def _add(into: dict[str, float], stats: dict[str, float]) -> None:
    """Accumulate statistics: sums, except the maxima (MAX_STATS)."""
    for key, value in stats.items():
        into[key] = max(into.get(key, value), value) if key in MAX_STATS else into.get(key, 0.0) + value


def zero_advantage_samples(table: pa.Table) -> torch.Tensor:
    """[rows] bool: samples of groups whose advantages are all exactly 0 (they carry no policy gradient); a
    sample's per-token advantages (`token_advantages`), where it has them, count instead of its scalar."""
    groups = table.column("group_id").to_pylist()
    advantages = table.column("advantage").to_pylist()
    if "token_advantages" in table.column_names:
        tokens = table.column("token_advantages").to_pylist()
        advantages = [a if t is None else float(any(t)) for a, t in zip(advantages, tokens, strict=True)]
    nonzero = {g for g, a in zip(groups, advantages, strict=True) if a != 0}
    return torch.tensor([g not in nonzero for g in groups], dtype=torch.bool)


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward is random (an active dropout: LoRA's, or a Hugging Face attention's)."""
    return any(
        (isinstance(m, torch.nn.Dropout) and m.p > 0) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0
        for m in model.modules()
    )


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
        loaded = self._load_model()  # version 0 or a checkpoint is loaded next
        self.tok, self.model = loaded.tokenizer, loaded.model
        self.vision_spec = self.model.vision_spec if is_vision(self.model) else None  # rows carry images
        self.lora = cfg.model.lora
        if lora.attach_to(self.model, self.lora, train=True):
            trainable, total = lora.trainable_fraction(self.model)
            log.info(f"LoRA: {trainable} of {total} parameters train ({trainable / total:.2%})")
        self.publication_files = loaded.publication_files()  # config.json, tokenizer: same every version
        self.version = self._load_weights()
        self.history = self._build_history() if self.tcfg.measure_mismatch and self.dist.is_main else None
        self.objective = Objective(self.tcfg)
        self.layout = self._layout()
        self.reference = self._build_reference() if self.tcfg.reference.enabled else None
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
        self.writes = None  # publications and checkpoints off the loop (one process only: a checkpoint is a collective)
        if self.tcfg.background_writes and not self.dist.enabled:
            self.writes = Writes(WRITE_TIMEOUT_S)
        if cfg.resume_step is not None:
            checkpoint.restore(self.fs, self.root, cfg.resume_step, self.state, self.dist)
            log.info(f"resumed from checkpoint step={cfg.resume_step}")
        # the flow's URI: trainer.json holds it redacted, MLFLOW_TRACKING_URI in full (config/tracking.py)
        uri = self._tracking_uri() if cfg.mlflow_run_id else None
        self.tracker = Tracker(self.fs, self.root, uri, cfg.mlflow_run_id)
        self.evals = EvalMerger(self.fs, self.root, self.tracker, cfg.eval)  # eval.interval > 0 only
        self.sender = None
        if cfg.weight_broadcast.type == "collective" and self.dist.is_main:  # rank 0 holds the gathered weights
            from engines.weight_transport import Sender

            self.sender = Sender(cfg.weight_broadcast)
        self.peak_flops: float | None = None  # measured at the first step (`_mfu`)
        self.checkpoint_now = CHECKPOINT_NOW  # a shared trainer gives each tenant its own (engines/trainer/shared.py)

    def _load_model(self) -> modeldir.LoadedModel:
        """The policy before any weights are loaded (a shared trainer's tenant shares a backbone instead)."""
        return modeldir.load(self.cfg.model, pretrained=False)

    def _tracking_uri(self) -> str | None:
        return resolve_tracking_uri(self.cfg.tracking.tracking_uri, self.cfg.run.output_dir)

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        o = self.tcfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        warmup = o.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1)))
        return optimizer, scheduler

    def measure_mismatch(self, batch: Batch, ids: list[str], zero: torch.Tensor, step: int) -> MismatchSums | None:
        """mismatch_kl's sums from the history's forward; marks `batch.measured`, the tokens the loss's forward
        adds (`_reused_rows`). Rows of older policies: a `trainer.mismatch_sample_fraction` sample, each standing
        for the rows left out. Before the zero-advantage filter: the history scores every completion token."""
        if self.history is None:
            return None
        sums = MismatchSums()
        qualifying = self.history.qualifying(batch)
        current = qualifying & (batch.versions == self.version)
        reused = current & self._reused_rows(batch, zero)
        batch.measured = batch.loss_mask * reused[:, None] if bool(reused.any()) else None
        replay = self.tcfg.enable_router_replay
        self.history.score(sums, batch, current & ~reused, self.layout, replay)
        older = torch.nonzero(qualifying & ~current).flatten()
        rows, weight = stale_sample(ids, older, self.tcfg.mismatch_sample_fraction, step)
        self.history.score(sums, batch, torch.isin(torch.arange(len(batch)), rows), self.layout, replay, weight)
        return sums

    def _reused_rows(self, batch: Batch, zero: torch.Tensor) -> torch.Tensor:
        """[B] bool: rows a forward of `optimize` scores with the weights before the update and with the
        history's numerics: every row the proximal scoring covers, else the first mini-batch's (later ones follow
        an optimizer step) unless dropout makes the training forward differ; never under torchrun (a rank holds
        a share); when rows may be packed (packing, prefix sharing), without the zero-advantage rows the filter
        leaves out (packing drops their tokens)."""
        rows = torch.zeros(len(batch), dtype=torch.bool)
        if self.dist.enabled or (not self.objective.needs_proximal and _has_dropout(self.model)):
            return rows
        if self.objective.needs_proximal:
            rows[:] = True
        else:
            rows[torch.tensor_split(torch.arange(len(batch)), self.tcfg.mini_batches)[0]] = True
        packs = self.tcfg.packing or self.layout.share is not None
        return rows & ~zero if self.tcfg.loss.zero_advantage == "filter" and packs else rows

    def _load_weights(self) -> int:
        """Weights of the checkpoint the flow chose, or the warm-up's version 0; returns the version."""
        step = self.cfg.resume_step
        if step is not None:
            checkpoint.restore_weights(self.fs, self.root, step, self.model)
            return step
        if not weights.is_published(self.fs, self.root, 0):
            raise SystemExit("no committed weights to start from; the warm-up publishes version 0")
        self.model.load_published(weights.load(self.fs, weights.version_dir(self.root, 0)))
        return 0

    def _build_history(self) -> PolicyHistory:
        """Recent policies for mismatch_kl: the current one plus the publications just before it."""
        keep = self.cfg.max_off_policy_steps + 1
        history = PolicyHistory(self.model, keep, self.tcfg.compute_dtype)
        for v in range(max(0, self.version - keep + 1), self.version):
            if weights.is_published(self.fs, self.root, v):
                history.add_state(v, weights.load(self.fs, weights.version_dir(self.root, v)))
        history.add(self.version, self.model)
        return history

    def _build_reference(self) -> CausalLM:
        """The frozen policy the KL penalty measures against: `trainer.reference.model`, or version 0 (the
        published start of this run, whatever checkpoint a resume loaded)."""
        path = self.tcfg.reference.model
        cfg = self.cfg.model.model_copy(update={"lora": None, **({"path": path} if path else {})})
        ref = modeldir.load(cfg, pretrained=path is not None)
        if ref.tokenizer.vocab_size != self.tok.vocab_size:
            raise SystemExit(
                f"trainer.reference.model={path!r} has a vocabulary of {ref.tokenizer.vocab_size} tokens, the "
                f"policy {self.tok.vocab_size}: the reference must share the policy's tokenizer"
            )
        model = ref.model
        if path is None:  # version 0 holds full weights, LoRA runs included (their adapters start at zero)
            model.load_published(weights.load(self.fs, weights.version_dir(self.root, 0)))
        log.info(f"reference policy for the KL penalty: {path or 'version 0'}")
        return model.eval().requires_grad_(False)

    def wait_for_rollouts(self, step: int):
        directory = rollouts.step_path(self.root, step)
        with heartbeat().waiting_on("orchestrator", f"waiting for rollouts step={step}"):
            while not is_committed(self.fs, directory):
                time.sleep(self.tcfg.poll_interval_s)
        return rollouts.read_step(self.fs, self.root, step)

    def _layout(self) -> Layout:
        """Padded, packed (`trainer.packing`) or prompt-sharing (`trainer.prefix_sharing`) forwards of about
        `micro_batch_size` samples' tokens (engines/trainer/layout.py)."""
        share = None
        if self.tcfg.prefix_sharing and self.dist.cp == 1:  # a context-parallel shard's mask has no prompt
            share = TokenCost(*flops.token_cost(self.model))
        return Layout(self.tcfg.micro_batch_size, self.tok.pad_id, self.tcfg.packing, share)

    def optimize(self, batch: Batch, mismatch: MismatchSums | None = None) -> dict:
        """`trainer.epochs` passes over the step's samples in `trainer.mini_batches` mini-batches, an optimizer
        step each; the proximal and reference logprobs the objective reads are scored first, without gradient.
        Under torchrun each rank takes its share of every mini-batch. The tokens in `batch.measured` add to
        `mismatch` from the first forward that scores them with the weights before any optimizer step."""
        minis = torch.tensor_split(torch.arange(len(batch)), self.tcfg.mini_batches)
        plan = [p for p in (self._plan(batch, rows) for rows in minis) if p[0]]
        for micros, _ in plan:
            self._score_fixed(micros, mismatch)
        tap = None if self.objective.needs_proximal else mismatch
        stats: dict[str, float] = {}
        losses, norms = [], []
        for _ in range(self.tcfg.epochs):
            for micros, counts in plan:
                loss, norm = self._optimizer_step(micros, counts, stats, tap)
                tap = None  # the weights have moved
                losses.append(loss)
                norms.append(norm)
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()  # warm-up counts rollout steps, whatever the optimizer steps per step
        self.model.eval()
        reduced = self._reduce(stats, losses, norms, lr, float(batch.loss_mask.sum().clamp(min=1)))
        # this rank's tokens per pass over the step's samples: fewer than theirs where prompts are shared
        return {**reduced, "forward_tokens": sum(forward_tokens(m.mb) for micros, _ in plan for m in micros)}

    def _plan(self, batch: Batch, rows: torch.Tensor) -> tuple[list[Micro], StepCounts]:
        """One mini-batch: this rank's micro-batches (context-parallel shards) and the counts it divides by."""
        if len(rows) == 0:
            return [], StepCounts(0.0, 0.0)
        mini = batch.select(rows)
        counts = StepCounts(float(mini.loss_mask.sum()), float((mini.loss_mask.sum(1) > 0).sum()))
        share, weight = distributed.local_share(mini, self.dist)
        micros = [
            Micro(context_parallel.shard(full, self.dist), w)
            for full, w in distributed.even_micro_batches(self.layout.split(share), weight, self.dist)
        ]
        return micros, counts

    @torch.no_grad()
    def _score_fixed(self, micros: list[Micro], mismatch: MismatchSums | None = None) -> None:
        """The logprobs that stay fixed through the step's optimizer steps: the proximal policy's (the weights
        before the first one, so they measure mismatch_kl of `measured` tokens too) and the reference policy's."""
        for m in micros:
            if self.objective.needs_proximal:
                self.model.eval()
                routing = routing_for(m.mb, self.tcfg.enable_router_replay)
                m.proximal = self._score(self.model, m.mb, routing).logprobs
                if mismatch is not None and m.mb.measured is not None:
                    mismatch.add(m.mb, m.proximal, m.mb.measured, routing)
            if self.reference is not None:
                m.reference = self._score(self.reference, m.mb).logprobs

    def _score(self, model: CausalLM, mb: Batch | PackedBatch, routing: Routing | None = None) -> Scored:
        """`model`'s logprobs of `mb`'s targets (on the sampler's kept support), as the loss forward takes them."""
        routing = routing or routing_for(mb, self.tcfg.enable_router_replay)
        with context_parallel.gathered_kv(self.dist), forward_precision(model, self.tcfg.compute_dtype):
            return scored_tokens(model, mb, routing)

    def _optimizer_step(
        self, micros: list[Micro], counts: StepCounts, stats: dict[str, float], mismatch: MismatchSums | None = None
    ) -> tuple[float, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in micros:
            mb = m.mb
            routing = routing_for(mb, self.tcfg.enable_router_replay)
            replayed = 0.0
            if routing is not None and routing.replay is not None:
                replayed = float(((routing.replay[..., 0, 0] >= 0) & (_scoring(mb) > 0)).sum())
            with context_parallel.gathered_kv(self.dist), forward_precision(self.model, self.tcfg.compute_dtype):
                scored = scored_tokens(self.model, mb, routing, entropy=True)  # on the sampler's kept support
            if mismatch is not None and mb.measured is not None:  # before this step's update: the sampler's weights
                mismatch.add(mb, scored.logprobs.detach(), mb.measured, routing)
            # the entropy is always reported; it carries a gradient only as a loss term (loss.entropy_coef > 0)
            entropy = (
                scored.entropy if self.objective.needs_entropy or scored.entropy is None else scored.entropy.detach()
            )
            loss, mb_stats = self.objective(token_scores(mb, scored.logprobs, entropy, m.proximal, m.reference), counts)
            (loss * m.weight).backward()  # weight 0: a stand-in that keeps the ranks' collectives in step
            loss_sum += float(loss.detach()) * m.weight
            heartbeat().advance()
            mb_stats.update(replayed=replayed, support_mismatch=float(scored.support_mismatch_tokens))
            # a stand-in adds nothing, but every rank must hold the same keys for the all-reduce
            _add(stats, mb_stats if m.weight else {k: -math.inf if k in MAX_STATS else 0.0 for k in mb_stats})
        grad_norm = parallel.clip_grad_norm(self.model, self.tcfg.optim.max_grad_norm, self.dist)
        self.optimizer.step()
        return loss_sum, grad_norm

    def _reduce(self, stats: dict, losses: list[float], norms: list[float], lr: float, tokens: float) -> dict:
        """The step's metrics: statistics summed (maxima taken) over ranks, then normalised."""
        keys = sorted(k for k in stats if k not in MAX_STATS)
        summed = distributed.all_reduce([stats[k] for k in keys] + losses, self.dist)
        maxima = distributed.all_reduce([stats.get(k, 0.0) for k in MAX_STATS], self.dist, "max")
        total = {**dict(zip(keys, summed, strict=False)), **dict(zip(MAX_STATS, maxima, strict=True))}
        step_losses = summed[len(keys) :]
        return {
            "loss": sum(step_losses) / len(step_losses),
            "grad_norm": max(norms),
            "lr": lr,
            **step_metrics(total, self.tcfg.epochs),
            "optimizer_steps": len(step_losses),
            "tokens": int(tokens),
            # completion tokens scored through the sampler's experts (router replay); 0 without replay
            "replayed_fraction": total.get("replayed", 0.0) / (tokens * self.tcfg.epochs),
            # kept-support tokens the trainer ranks outside its own top k (docs/algorithm.md "Keep sampling mask")
            "support_mismatch_tokens": int(total.get("support_mismatch", 0.0) / self.tcfg.epochs),
        }

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        table, manifest = self.wait_for_rollouts(step)
        t1 = time.perf_counter()
        heartbeat().advance(f"training step {step}")
        batch = make_batch(table, self.tok.pad_id, self.tcfg.keep_sampling_mask, self.vision_spec)
        completion_tokens = float(batch.loss_mask.sum())
        zero = zero_advantage_samples(table)
        t_mismatch = time.perf_counter()
        sums = self.measure_mismatch(batch, table.column("sample_id").to_pylist(), zero, step)
        t_mismatch = time.perf_counter() - t_mismatch
        if self.tcfg.loss.zero_advantage == "filter":
            batch.loss_mask[zero] = 0.0
        stats = self.optimize(batch, sums)
        mismatch = sums.result() if sums else Mismatch(None, 0, None)
        t2 = time.perf_counter()
        published = parallel.full_state_dict(self.model, self.dist)  # a collective; rank 0 keeps the weights
        broadcast_s = None
        if self.dist.is_main:
            # collective transport first: the engine has the tensors before the orchestrator sees the commit
            broadcast_s = self.sender.send(step, published) if self.sender else None
            if self.writes is not None and not self.lora:  # LoRA's publication reads the live adapters
                self.writes.submit(f"publication {step}", functools.partial(self.publish, step, copied(published)))
            else:
                self.publish(step, published)
        self.version = step
        if self.history and self.dist.enabled:
            self.history.add_state(step, published)
        elif self.history:
            self.history.add(step, self.model)
        t3, finished = time.perf_counter(), time.time()
        heartbeat().advance(f"published step {step}")
        mfu = self._mfu(
            batch, int(stats["forward_tokens"]), t2 - t1
        )  # after publishing: the first call measures the peak (~0.3 s)
        if self.dist.is_main:  # a few samples' images, every tracking.image_every steps (engines/trainer/tracking.py)
            self.tracker.log_samples(step, table, self.cfg.tracking)
        stale = [staleness(step, v) for v in table.column("policy_version").to_pylist()]
        rewards = table.column("reward").to_pylist()
        return {
            "step": step,
            "time": finished,
            "reward_mean": sum(rewards) / len(rewards),
            "mismatch_kl": mismatch.kl,
            **{f"mismatch_kl/images={k}": kl for k, kl in (mismatch.by_images or {}).items()},
            "mismatch_tokens": mismatch.tokens,
            "expert_mismatch": mismatch.expert_mismatch,
            **stats,
            "samples": len(rewards),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            "completion_len_mean": completion_tokens / len(rewards),
            "zero_advantage_fraction": float(zero.float().mean()),
            **({} if batch.images_dropped is None else {"images_dropped": int(batch.images_dropped.sum())}),
            "wait_s": t1 - t0,
            "train_s": t2 - t1,
            **mfu,
            "mismatch_s": t_mismatch,  # the history's forward (train_s includes it)
            "publish_s": t3 - t2,
            "broadcast_s": broadcast_s,
            "step_s": t3 - t0,
            "gen_s": manifest.get("gen_s"),
            # image prompts the orchestrator dropped before sampling (engines/orchestrator/prompts.py)
            **{k: manifest[k] for k in ("overflow_dropped", "image_refused") if k in manifest},
            **rollouts.metric_means(table),
            **rollouts.teacher_kl(table),
        }

    def publish(self, step: int, published: dict[str, torch.Tensor]) -> None:
        """Policy version `step`: the full weights (`published`, gathered on rank 0), or with LoRA the adapters
        on version 0 (LoRA runs on one trainer process: config/run.py); then retention's pass."""
        if self.lora:
            lora.publish(self.publisher, self.model, self.lora, step, self.publication_files)
        else:
            self.publisher.publish(step, published, self.publication_files)
        retention.enforce(self.fs, self.root, bases=self.publisher.bases)  # a no-op unless storage.keep_last_*

    def _mfu(self, batch: Batch, forwarded: int, train_s: float) -> dict[str, float]:
        """{"mfu", "train_gflops"}: the step's matmul FLOPs (every epoch's pass over the `forwarded` tokens) per
        second of train_s, against the matmul peak measured at the first step; {} when off or under torchrun."""
        if not self.tcfg.report_mfu or self.dist.enabled or train_s <= 0:
            return {}
        lengths = (batch.input_ids != self.tok.pad_id).sum(dim=1).float()
        if self.peak_flops is None:
            shapes = flops.linear_shapes(self.model)
            tokens_mb = min(1024, int(lengths.max()) * min(len(batch), self.tcfg.micro_batch_size))  # a micro-batch's
            dtype = getattr(torch, self.tcfg.compute_dtype)
            self.peak_flops = flops.matmul_peak(shapes, max(1, tokens_mb), dtype)
            log.info(f"measured matmul peak at the model's shapes: {self.peak_flops / 1e9:.1f} GFLOP/s ({dtype})")
        achieved = self.tcfg.epochs * flops.step_flops(self.model, forwarded, float(lengths.mean())) / train_s
        return {"mfu": achieved / self.peak_flops, "train_gflops": achieved / 1e9}

    def ready(self, step: int) -> bool:
        """Whether step `step`'s rollouts are committed (never blocks): `train_step` would not wait."""
        return is_committed(self.fs, rollouts.step_path(self.root, step))

    def train_step(self, step: int) -> dict:
        """One whole step: train on step's rollouts (waiting for them), publish, report, checkpoint when due."""
        row = self.step(step)
        if self.dist.is_main:
            self._report(step, row)
            self.evals.merge(step)
        # every rank must checkpoint at the same step: SIGUSR1 may reach them a step apart
        nudged = distributed.all_reduce([float(self.checkpoint_now.is_set())], self.dist, "max")[0]
        if step % self.cfg.checkpoint.interval == 0 or step == self.cfg.max_steps or nudged:
            self.checkpoint_now.clear()
            if self.writes is not None and step < self.cfg.max_steps and not nudged:
                captured = checkpoint.capture(self.fs, self.root, step, self.state, copy=True)
                self.writes.submit(f"checkpoint step={step}", functools.partial(self._checkpoint, step, captured))
                return row
            if self.writes is not None:
                self.writes.wait()
            self._checkpoint(step, checkpoint.capture(self.fs, self.root, step, self.state, self.dist))
        return row

    def _checkpoint(self, step: int, captured: checkpoint.Captured) -> None:
        written = checkpoint.write(self.fs, self.root, captured, self.dist)
        heartbeat().advance(f"checkpoint step={step} written")
        if self.dist.is_main:
            log.info(f"checkpoint written: {written}")
            retention.enforce(self.fs, self.root, bases=self.publisher.bases)

    def run(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: CHECKPOINT_NOW.set())
        try:
            for step in range(self.version + 1, self.cfg.max_steps + 1):
                self.train_step(step)
            if self.dist.is_main:
                with heartbeat().waiting_on("orchestrator", "waiting for the final evaluation"):
                    self.evals.wait_final(self.cfg.max_steps)
        finally:
            if self.writes is not None:
                self.writes.wait()
            self.tracker.close()  # what MLflow has not taken yet (metrics.jsonl has every row)
        distributed.shutdown(self.dist)

    def _report(self, step: int, row: dict) -> None:
        self.tracker.record(row)
        kl = "n/a" if row["mismatch_kl"] is None else f"{row['mismatch_kl']:.1e}"
        log.info(
            f"step {step}/{self.cfg.max_steps} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f} "
            f"| mismatch_kl {kl} | staleness {row['staleness_mean']:.2f} | masked {row['masked_fraction']:.3f} "
            f"| train {row['train_s']:.2f}s wait {row['wait_s']:.2f}s"
            + (f" | mfu {row['mfu']:.1%}" if "mfu" in row else "")
        )
