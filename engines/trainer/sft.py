"""Supervised fine-tuning: next-token loss on the trained tokens of each sample (assistant turns, reference
answers, chosen rollouts' completions), averaged over the batch's trained tokens.

Two uses of one loop (`config/process.py` SFTProcessConfig):
- the RL warm-up (`sft_run` None): the environments' reference answers for `sft.steps` steps, so RL starts
  from a reward that is neither ~0 nor saturated; published as policy version 0, never checkpointed;
- a `rollflow sft` run: any `[sft.data]` source (engines/trainer/sft_data.py), metrics per step, a checkpoint
  (weights, optimizer, RNG, data cursor) and a publication `weights/step=N` every `checkpoint.interval` steps
  and at the end; a restart continues from the checkpoint the flow names and takes the same steps.

Per step: the batch's samples -> right-padded `Batch` (engines/trainer/batch.py) -> this rank's rows ->
packed rows with block-diagonal attention (`sft.packing`) -> micro-batches -> backward -> one AdamW step.
The model comes from `model` (engines/models/modeldir.py): the built-in one is trained from scratch; a
pretrained directory is loaded with its weights (with `[model.lora]`, adapters train), and with `sft.steps = 0`
the warm-up publishes it as it is.
"""

from __future__ import annotations

import time

import torch

from config.process import SFTProcessConfig
from config.tracking import resolve_tracking_uri
from engines.environments import multimodal
from engines.environments.base import EnvironmentRefused, EnvMix
from engines.environments.episodes import demonstration_ids, is_multi_turn
from engines.heartbeat import heartbeat
from engines.models import lora, modeldir
from engines.models.tokenizer import Tokenizer
from engines.models.vision import VisionSpec, pixel_inputs
from engines.models.vlm import is_vision
from engines.trainer import checkpoint, distributed, expert_parallel, parallel
from engines.trainer.batch import Batch, PackedBatch, micro_batches, pack_batch, right_pad
from engines.trainer.common import log, seed_everything, train_logprobs
from engines.trainer.sft_data import Dataset, Sample, Stream, load_files, load_lake
from engines.trainer.tracking import Tracker
from storage import retention, weights
from storage.fs import Storage, join, write_bytes_atomic, write_json
from storage.metrics import SFT_DATA_FILE


class EnvDemos:
    """The environments' reference answers as an endless stream: the n-th batch of `size` draws the tasks
    `sft/{n}/{j}` (n from 1), so a batch depends on its position only. `spec`: a vision-language policy's image
    token layout, for tasks with images."""

    def __init__(self, mix: EnvMix, tok: Tokenizer, spec: VisionSpec | None = None):
        self.mix, self.tok, self.spec, self.cursor = mix, tok, spec, 0

    def take(self, size: int) -> list[Sample]:
        step = self.cursor // size + 1
        self.cursor += size
        return [demonstration(self.mix, self.tok, f"sft/{step}/{j}", self.spec) for j in range(size)]

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])


def demonstration(mix: EnvMix, tok: Tokenizer, key: str, spec: VisionSpec | None = None) -> Sample:
    """A task's reference answer and end-of-sequence after its rendered prompt (in a multi-turn environment's
    reference episode: every reply's tokens, never the environment's). A task with images (a vision-language
    policy: `spec`) renders them before its text, each placeholder widened to its image's tokens."""
    task = mix.task(key)
    env = mix.envs[task.env]
    if is_multi_turn(env):
        return Sample(*demonstration_ids(env, task, tok))  # type: ignore[arg-type]
    images = multimodal.images_of(task)
    try:
        prompt = multimodal.prompt_ids(tok, task, spec)
    except EnvironmentRefused as exc:
        raise SystemExit(str(exc)) from None
    seq = prompt + tok.encode(task.answer, bos=False) + [tok.eos_id]
    return Sample(seq, [0] * len(prompt) + [1] * (len(seq) - len(prompt)), images)


def to_batch(samples: list[Sample], pad_id: int, spec: VisionSpec | None = None) -> Batch:
    """Right-padded ids with the loss mask over targets (target t is token t + 1), as the RL trainer's batch;
    with a vision-language policy's `spec`, each sample's images as encoder inputs."""
    ids = right_pad([s.ids for s in samples], pad_id)
    mask = torch.zeros((len(samples), ids.shape[1] - 1))
    for i, s in enumerate(samples):
        mask[i, : len(s.ids) - 1] = torch.tensor(s.mask[1:], dtype=torch.float32)
    ones, zeros = torch.ones(len(samples)), torch.zeros(len(samples), dtype=torch.long)
    batch = Batch(ids, ids[:, 1:], mask, torch.zeros_like(mask), ones, ones.clone(), zeros, zeros.clone())
    batch.lengths = torch.tensor([len(s.ids) for s in samples])
    if spec is not None:
        batch.pixels = [pixel_inputs(s.images, spec) for s in samples]
        batch.image_counts = torch.tensor([len(s.images) for s in samples], dtype=torch.long)
    return batch


def vision_spec(model: object) -> VisionSpec | None:
    """A vision-language policy's image token layout; None for a text model."""
    return model.vision_spec if is_vision(model) else None  # type: ignore[attr-defined]


def sft_batch(mix: EnvMix, tok: Tokenizer, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The warm-up's batch `step` (from 1): right-padded token ids and the loss mask over targets."""
    stream = EnvDemos(mix, tok)
    stream.cursor = (step - 1) * size
    batch = to_batch(stream.take(size), tok.pad_id)
    return batch.input_ids, batch.loss_mask


def train_step(model, opt, batch: Batch, cfg: SFTProcessConfig, dist, pad_id: int) -> tuple[float, int]:
    """One optimizer step on the batch (every rank holds all of it and trains its share of the rows); returns
    (mean loss per trained token over the whole batch, rows this rank ran)."""
    tokens = batch.loss_mask.sum().clamp(min=1)
    share, weight = distributed.local_share(batch, dist)
    size = cfg.sft.micro_batch_size or len(share)  # rows per forward; packing makes fewer, fuller rows
    if cfg.sft.packing and share.packable:  # a vision-language policy's rows stay padded (Batch.packable)
        mbs: list[Batch] | list[PackedBatch] = micro_batches(pack_batch(share, pad_id, cfg.model.max_seq_len), size)
    else:
        mbs = micro_batches(share, size)
    model.train()
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for mb, w in distributed.even_micro_batches(mbs, weight, dist):
        loss = -(train_logprobs(model, mb) * mb.loss_mask).sum() / tokens.to(mb.loss_mask.device)
        (loss * w).backward()  # gradients summed over ranks: each loss is already over the whole batch's tokens
        total += float(loss.detach()) * w
    expert_parallel.drop_unrouted_grads(model.weights_module(), dist)
    opt.step()
    return distributed.all_reduce([total], dist)[0], sum(len(mb) for mb in mbs)


def open_data(cfg: SFTProcessConfig, tok: Tokenizer, storage: Storage) -> Dataset | None:
    """The `[sft.data]` dataset, loaded and checked; None for the environments' endless demonstrations."""
    data = cfg.sft.data
    if data.type == "files":
        fs, path = storage.open(data.path)
        return load_files(data.model_copy(update={"path": path}), tok, cfg.model.max_seq_len, fs)
    if data.type == "lake":
        return load_lake(data, tok, cfg.model.max_seq_len, cfg.run.storage)
    return None


def run_sft(cfg: SFTProcessConfig) -> None:
    """The warm-up or a `rollflow sft` run, in one process or on torchrun's ranks (`cfg.parallel`: FSDP2 over
    all of them, each rank a slice of every batch; rank 0 publishes, records and commits)."""
    seed_everything(cfg.seed, cfg.num_threads)
    dist = distributed.init(cfg.parallel)
    storage = Storage(cfg.run.storage)
    fs, root = storage.open(cfg.run.output_dir)
    loaded = modeldir.load(cfg.model, pretrained=True)
    tok, model = loaded.tokenizer, loaded.model
    # LoRA needs pretrained weights to adapt: the built-in model trains all weights from scratch.
    adapters = cfg.model.lora if loaded.source.directory is not None else None
    if lora.attach_to(model, adapters, train=True):
        trainable, total = lora.trainable_fraction(model)
        log.info(f"LoRA: {trainable} of {total} parameters train ({trainable / total:.2%})")
    dataset = open_data(cfg, tok, storage)
    source: Stream | EnvDemos | None = None
    if dataset:
        source = Stream(dataset, cfg.seed)
    elif cfg.sft_run is not None or cfg.sft.steps > 0:
        # a warm-up without steps draws no demonstration: building the environments (a verifiers
        # environment imports its package and loads its dataset, seconds) would only delay the run
        source = EnvDemos(EnvMix(cfg.envs, cfg.seed, tok.prompt_style), tok, vision_spec(model))
    job = SFTJob(cfg, dist, fs, root, loaded, adapters, source)
    if cfg.sft_run is not None and cfg.sft_run.resume_step is not None:
        checkpoint.restore_weights(fs, root, cfg.sft_run.resume_step, model)  # before the model is sharded
    parallel.parallelize(model, dist, cfg.parallel, loaded.source.impl)
    # a warm-up without steps only publishes version 0: no optimizer (its first use imports torch._dynamo, ~1.5 s)
    if cfg.sft_run is not None or job.steps() > 0:
        job.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr)
    if cfg.sft_run is None:
        job.warm_up()
    else:
        job.run(dataset)
    distributed.barrier(dist)
    distributed.shutdown(dist)


class SFTJob:
    """The loop and its outputs: publications, checkpoints, metrics."""

    def __init__(self, cfg: SFTProcessConfig, dist, fs, root: str, loaded, adapters, source: Stream | EnvDemos | None):
        self.cfg, self.dist, self.fs, self.root = cfg, dist, fs, root
        self.loaded, self.model, self.adapters, self.source = loaded, loaded.model, adapters, source
        self.files = loaded.publication_files()  # config.json, tokenizer: the same every publication
        self.opt: torch.optim.Optimizer | None = None
        self.spec = vision_spec(loaded.model)

    def steps(self) -> int:
        s = self.cfg.sft
        if s.epochs is not None and isinstance(self.source, Stream):
            return self.source.steps_for(s.epochs, s.batch_size)
        return s.steps

    def step(self) -> tuple[float, int, int]:
        """(loss, trained tokens, rows this rank ran) of the next batch."""
        assert self.opt is not None and self.source is not None
        batch = to_batch(self.source.take(self.cfg.sft.batch_size), self.loaded.tokenizer.pad_id, self.spec)
        loss, rows = train_step(self.model, self.opt, batch, self.cfg, self.dist, self.loaded.tokenizer.pad_id)
        heartbeat().advance("training")
        return loss, int(batch.loss_mask.sum()), rows

    def warm_up(self) -> None:
        steps = self.steps()
        for step in range(1, steps + 1):
            loss, _, _ = self.step()
            if step % 10 == 0 or step == steps:
                log.info(f"warm-up step {step}/{steps} | loss {loss:.3f}")
        state = self.published_state()
        if self.dist.is_main:
            save_tokenizer(self.files, self.fs, join(self.root, "tokenizer"))
            self.publish(0, state)
            log.info("warm-up done: published policy version 0")

    def published_state(self) -> dict:
        """The full weights (gathered on rank 0: a collective with ranks); with LoRA, merged at publication."""
        return parallel.full_state_dict(self.model, self.dist) if self.adapters is None else {}

    def publish(self, version: int, state: dict) -> str:
        """`weights/step=version` as a Hugging Face directory; with LoRA the merged model, and the raw adapter
        beside it under `adapter/` (a PEFT directory on the base model)."""
        if self.adapters is None:
            return weights.publish(self.fs, self.root, version, state, self.files)
        base = str(self.loaded.source.directory)
        raw = {f"adapter/{n}": b for n, b in lora.peft_files(self.model.eval(), self.adapters, base).items()}
        return weights.publish(self.fs, self.root, version, lora.merged_state_dict(self.model), self.files | raw)

    def run(self, dataset: Dataset | None) -> None:
        job = self.cfg.sft_run
        assert job is not None and self.opt is not None and self.source is not None
        parts: dict[str, checkpoint.Stateful] = {"optimizer": self.opt, "rng": checkpoint.RNGState()}
        parts["data"] = self.source
        if self.adapters is not None:
            parts["lora"] = lora.AdapterPart(self.model)  # the base is saved as the weights
        state = checkpoint.TrainerState(self.model, parts, job.mlflow_run_id, self.cfg.seed, self.files)
        start = job.resume_step or 0
        if job.resume_step is not None:
            checkpoint.restore(self.fs, self.root, job.resume_step, state, self.dist)
            log.info(f"resumed from checkpoint step={job.resume_step}")
        tracker = self.tracker() if self.dist.is_main else None
        if self.dist.is_main:
            save_tokenizer(self.files, self.fs, join(self.root, "tokenizer"))
            write_json(self.fs, join(self.root, SFT_DATA_FILE), self.report(dataset))
        steps = self.steps()
        try:
            for step in range(start + 1, steps + 1):
                row = self.timed_step(step, steps)
                if tracker is not None:
                    tracker.record(row)
                if step % job.checkpoint.interval == 0 or step == steps:
                    self.commit(step, state)
        finally:
            if tracker is not None:
                tracker.close()  # what MLflow has not taken yet (metrics.jsonl has every row)

    def timed_step(self, step: int, steps: int) -> dict:
        t0 = time.perf_counter()
        loss, tokens, rows = self.step()
        row = {"step": step, "time": time.time(), "loss": loss, "trained_tokens": tokens}
        row |= {"samples": self.cfg.sft.batch_size, "rows": rows, "lr": self.cfg.sft.lr}
        if isinstance(self.source, Stream):
            row["epoch"] = self.source.cursor / len(self.source.data.samples)
        row["step_s"] = time.perf_counter() - t0
        if self.dist.is_main:
            log.info(f"sft step {step}/{steps} | loss {loss:.4f} | tokens {tokens} | {row['step_s']:.2f}s")
        return row

    def commit(self, step: int, state: checkpoint.TrainerState) -> None:
        """Publish `weights/step=N`, then checkpoint step N (a restart rolls back publications newer than it)."""
        published = self.published_state()
        if self.dist.is_main:
            log.info(f"published {self.publish(step, published)}")
        written = checkpoint.save(self.fs, self.root, step, state, self.dist)
        if self.dist.is_main:
            log.info(f"checkpoint written: {written}")
            retention.enforce(self.fs, self.root)

    def tracker(self) -> Tracker:
        job = self.cfg.sft_run
        assert job is not None
        # the flow's URI: sft.json holds it redacted, MLFLOW_TRACKING_URI in full (config/tracking.py)
        uri = resolve_tracking_uri(job.tracking.tracking_uri, self.cfg.run.output_dir) if job.mlflow_run_id else None
        return Tracker(self.fs, self.root, uri, job.mlflow_run_id)

    def report(self, dataset: Dataset | None) -> dict:
        base = dataset.report if dataset is not None else {"source": "environments' demonstrations"}
        return {**base, "steps": self.steps(), "batch_size": self.cfg.sft.batch_size, "epochs": self.cfg.sft.epochs}


def save_tokenizer(files: dict[str, bytes], fs, directory: str) -> None:
    """The run's HF-format tokenizer files (any fsspec filesystem): a publication's files minus its configs."""
    for name, data in files.items():
        if name not in ("config.json", "generation_config.json"):
            write_bytes_atomic(fs, join(directory, name), data)
