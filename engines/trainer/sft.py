"""Supervised warm-up: teach the format (the rendered prompt -> answer + end-of-sequence) briefly, so RL
starts from a reward that is neither ~0 nor saturated; the result is published as policy version 0.

The model comes from `model` (engines/models/modeldir.py): the built-in one is trained from scratch; a
pretrained directory is loaded with its weights, and with `sft.steps = 0` published as it is.
"""

from __future__ import annotations

import torch

from config.process import SFTProcessConfig
from engines.environments.base import EnvMix
from engines.environments.episodes import demonstration_ids, is_multi_turn
from engines.models import lora, modeldir
from engines.models.tokenizer import Tokenizer
from engines.trainer import distributed, expert_parallel, parallel
from engines.trainer.batch import right_pad
from engines.trainer.common import log, seed_everything
from storage import weights
from storage.fs import Storage, join, write_bytes_atomic


def sft_batch(mix: EnvMix, tok: Tokenizer, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and a loss mask that covers answer tokens and the end-of-sequence only
    (in a multi-turn environment's reference episode: every reply's tokens, never the environment's)."""
    seqs, masks = [], []
    for j in range(size):
        task = mix.task(f"sft/{step}/{j}")
        env = mix.envs[task.env]
        if is_multi_turn(env):
            seq, token_mask = demonstration_ids(env, task, tok)  # type: ignore[arg-type]
        else:
            prompt = tok.render_prompt(task.prompt)
            seq = prompt + tok.encode(task.answer, bos=False) + [tok.eos_id]
            token_mask = [0] * len(prompt) + [1] * (len(seq) - len(prompt))
        seqs.append(seq)
        masks.append(token_mask[1:])  # target t is token t + 1
    ids = right_pad(seqs, tok.pad_id)
    mask = torch.zeros((size, ids.shape[1] - 1))
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def run_sft(cfg: SFTProcessConfig) -> None:
    """The warm-up, in one process or on torchrun's ranks (`cfg.parallel`: FSDP2 over all of them, each
    rank a slice of every batch; rank 0 publishes)."""
    seed_everything(cfg.seed, cfg.num_threads)
    dist = distributed.init(cfg.parallel)
    fs, root = Storage(cfg.run.storage).open(cfg.run.output_dir)
    loaded = modeldir.load(cfg.model, pretrained=True)
    tok, model = loaded.tokenizer, loaded.model
    # LoRA needs pretrained weights to adapt: the built-in model's warm-up trains all weights from scratch.
    adapters = cfg.model.lora if loaded.source.directory is not None else None
    if lora.attach_to(model, adapters, train=True):
        trainable, total = lora.trainable_fraction(model)
        log.info(f"LoRA warm-up: {trainable} of {total} parameters train ({trainable / total:.2%})")
    parallel.parallelize(model, dist, cfg.parallel, loaded.source.impl)
    mix = EnvMix(cfg.envs, cfg.seed, tok.prompt_style)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr)
    for step in range(1, cfg.sft.steps + 1):
        ids, mask = sft_batch(mix, tok, step, cfg.sft.batch_size)  # the whole batch, the same on every rank
        rows, weight = distributed.local_rows(ids.shape[0], dist)
        loss = weight * sft_loss(model, ids[rows].to(dist.device), mask[rows].to(dist.device), mask.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # gradients summed over the ranks: each loss is already over the whole batch's tokens
        expert_parallel.drop_unrouted_grads(model.weights_module(), dist)
        opt.step()
        if step % 10 == 0 or step == cfg.sft.steps:
            total_loss = distributed.all_reduce([loss.item()], dist)[0]
            log.info(f"warm-up step {step}/{cfg.sft.steps} | loss {total_loss:.3f}")
    state = parallel.full_state_dict(model, dist) if adapters is None else {}  # a collective with ranks
    if dist.is_main:
        publish_version_0(model, loaded, adapters, state, fs, root)
    distributed.barrier(dist)
    distributed.shutdown(dist)


def sft_loss(model, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss on the masked tokens of these rows, over `tokens` (the whole batch's count)."""
    logits = model(ids)[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * mask).sum() / tokens


def publish_version_0(model, loaded, adapters, state: dict, fs, root: str) -> None:
    """Version 0 and the run's tokenizer (`state`: the full weights, gathered on rank 0 with ranks)."""
    files = loaded.publication_files()
    save_tokenizer(files, fs, join(root, "tokenizer"))
    if adapters is None:
        weights.publish(fs, root, 0, state, files)
    else:  # version 0 is the merged model (the base of the RL adapters), with the raw warm-up adapter beside it
        raw = {
            f"adapter/{n}": b for n, b in lora.peft_files(model.eval(), adapters, str(loaded.source.directory)).items()
        }
        weights.publish(fs, root, 0, lora.merged_state_dict(model), files | raw)
    log.info("warm-up done: published policy version 0")


def save_tokenizer(files: dict[str, bytes], fs, directory: str) -> None:
    """The run's HF-format tokenizer files (any fsspec filesystem): a publication's files minus its configs."""
    for name, data in files.items():
        if name not in ("config.json", "generation_config.json"):
            write_bytes_atomic(fs, join(directory, name), data)
