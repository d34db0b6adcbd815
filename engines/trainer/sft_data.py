"""The samples supervised fine-tuning trains on, from any `[sft.data]` source, and the order it takes them in.

A sample is token ids with a mask over them (1: a token the model learns to produce). Sources:
- `envs`: the environments' reference answers, drawn endlessly (`sft/{step}/{j}` task keys): the RL warm-up;
- `files`: conversations (engines/trainer/sft_files.py reads them) rendered with `render_conversation`:
  every assistant turn trained, everything else masked;
- `lake`: a run's rollouts selected by storage/lake.py's filters, as their stored token ids (the completion's
  model tokens trained) or re-rendered from their text; a rollout's images (checked against their digests)
  stay with its sample.
Every row is checked when the dataset loads; a bad one (no messages column, not a conversation, an unknown
role, no assistant turn, longer than model.max_seq_len, a token outside the vocabulary) refuses the dataset
naming the file and row, or with `on_bad_row = "skip"` is dropped and counted by reason (`Dataset.report`).
A dataset is taken in shuffled epochs: epoch e is a permutation seeded by (seed, e), and the run reads the
concatenated epochs from a cursor (samples consumed), which a checkpoint stores with the dataset's fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from config.sft import FileData, LakeData
from engines.models.tokenizer import ROLES, Tokenizer, render_conversation
from engines.trainer.sft_files import MISSING, BadRow, DataError, dataset_files, display, read_rows

log = logging.getLogger("rollflow.trainer")


@dataclass
class Sample:
    ids: list[int]
    mask: list[int]  # over ids: 1 where the token is trained
    images: tuple[bytes, ...] = ()  # the images its ids' image tokens stand for, in order (vision-language)


@dataclass
class Dataset:
    samples: list[Sample]
    report: dict[str, Any]  # source, rows, samples, skipped (by reason), tokens, trained_tokens

    def fingerprint(self) -> str:
        """A digest of every sample's ids and mask, in order: a resume must read the same data."""
        h = hashlib.sha256()
        for s in self.samples:
            h.update(repr((s.ids, s.mask)).encode())
            for image in s.images:
                h.update(hashlib.sha256(image).digest())
        return h.hexdigest()[:16]


@dataclass
class Collector:
    """Checks rows as they are read: keeps the good ones, refuses or counts the bad ones."""

    tok: Tokenizer
    max_len: int
    on_bad_row: str
    samples: list[Sample] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    rows: int = 0

    def add(self, origin: str, make) -> None:
        """`make()` builds the sample or raises BadRow; `origin` names the file and row in messages."""
        self.rows += 1
        try:
            sample = make()
            if len(sample.ids) > self.max_len:
                raise BadRow("too_long", f"{len(sample.ids)} tokens, more than model.max_seq_len = {self.max_len}")
            if any(not 0 <= t < self.tok.vocab_size for t in sample.ids):
                raise BadRow("unknown_token", f"token ids outside this model's vocabulary of {self.tok.vocab_size}")
        except BadRow as exc:
            if self.on_bad_row == "error":
                raise DataError(
                    f"{origin}: {exc}; fix the row, or set [sft.data] on_bad_row = 'skip' to drop such rows"
                ) from None
            if not self.skipped:
                log.warning(f"skipping bad rows (on_bad_row = 'skip'); the first: {origin}: {exc}")
            self.skipped[exc.reason] += 1
            return
        self.samples.append(sample)

    def dataset(self, source: str) -> Dataset:
        if not self.samples:
            raise DataError(f"{source}: no usable sample ({self.rows} rows read, skipped: {dict(self.skipped)})")
        report = {
            "source": source,
            "rows": self.rows,
            "samples": len(self.samples),
            "skipped": dict(sorted(self.skipped.items())),
            "tokens": sum(len(s.ids) for s in self.samples),
            "trained_tokens": sum(sum(s.mask) for s in self.samples),
        }
        if self.skipped:
            log.warning(f"skipped {sum(self.skipped.values())} of {self.rows} rows: {dict(self.skipped)}")
        return Dataset(self.samples, report)


def conversation(tok: Tokenizer, messages: Any) -> Sample:
    """A chat's sample (`render_conversation`); BadRow for anything that is not a conversation to train on."""
    if messages is MISSING or messages is None:
        raise BadRow("missing_column", "no messages column")
    if isinstance(messages, BadRow):
        raise messages
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRow("not_a_conversation", f"messages is not a list of {{role, content}} objects: {messages!r:.80}")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role {m.get('role')!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise BadRow("not_a_conversation", f"message {i} has no text content")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn", "no assistant turn to train on")
    try:
        ids, mask = render_conversation(tok, [{"role": m["role"], "content": m["content"]} for m in messages])
    except Exception as exc:  # a chat template may refuse an order of roles (jinja raises its own errors)
        raise BadRow("template_error", f"the chat template does not render it: {exc}") from None
    return Sample(ids, mask)


def load_files(spec: FileData, tok: Tokenizer, max_len: int, fs: Any) -> Dataset:
    """Every row of every file `spec.path` names, checked (see the module doc)."""
    collect = Collector(tok, max_len, spec.on_bad_row)
    for path, fmt in dataset_files(fs, spec.path, spec.format):
        name = display(fs, path)
        for n, value in read_rows(fs, path, fmt, spec.messages_column):
            column = f" (column {spec.messages_column!r})" if value is MISSING else ""
            collect.add(f"{name}: row {n}{column}", lambda v=value: conversation(tok, v))
    return collect.dataset(display(fs, spec.path))


def load_lake(spec: LakeData, tok: Tokenizer, max_len: int, storage: Any) -> Dataset:
    """The selected rollouts of `spec.run` (storage/lake.py `selected`), read from its shards in place."""
    from storage.lake import parse_steps, selected

    steps = parse_steps(spec.steps) if spec.steps else (None, None)
    collect = Collector(tok, max_len, spec.on_bad_row)
    chosen = selected(spec.run, steps, spec.env, spec.min_reward, spec.max_reward, spec.limit, storage)
    for step, table in chosen:
        for i, row in enumerate(table.to_pylist()):
            origin = f"{spec.run}/rollouts/step={step:06d}: row {i + 1} (sample {row['sample_id']})"
            collect.add(origin, lambda r=row: lake_sample(tok, r, spec.tokens))
    return collect.dataset(f"{spec.run} (rollouts)")


def lake_sample(tok: Tokenizer, row: dict, tokens: str) -> Sample:
    """A rollout as stored (`ids`: its completion's model tokens trained) or re-rendered from its text."""
    images = tuple(row.get("images") or ())
    digests = row.get("image_sha256")
    if digests is not None and [hashlib.sha256(b).hexdigest() for b in images] != list(digests):
        raise BadRow("image_digest", "its images do not match their image_sha256 digests")
    if tokens == "text":
        if images:
            raise BadRow("images", "a sample with images is trained on its stored ids; use tokens = 'ids'")
        if row.get("completion_mask") is not None:
            raise BadRow("multi_turn", "a multi-turn episode has no single completion text; use tokens = 'ids'")
        user, reply = row["prompt_text"], row["completion_text"]
        return conversation(tok, [{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    prompt, completion = row["prompt_ids"], row["completion_ids"]
    turn_mask = row.get("completion_mask") or [1] * len(completion)
    if not any(turn_mask):
        raise BadRow("no_assistant_turn", "no completion token to train on")
    return Sample(prompt + completion, [0] * len(prompt) + list(turn_mask), images)


class Stream:
    """The dataset in shuffled epochs, read from a cursor (samples consumed so far)."""

    def __init__(self, data: Dataset, seed: int):
        self.data, self.seed, self.cursor = data, seed, 0
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.data.samples)))
            random.Random(f"sft/{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}  # epochs are read in turn: keep one
        return self._orders[epoch]

    def take(self, count: int) -> list[Sample]:
        n = len(self.data.samples)
        picked = [self.data.samples[self.order(p // n)[p % n]] for p in range(self.cursor, self.cursor + count)]
        self.cursor += count
        return picked

    def steps_for(self, epochs: int, batch_size: int) -> int:
        return math.ceil(epochs * len(self.data.samples) / batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "fingerprint": self.data.fingerprint(), "samples": len(self.data.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.data.fingerprint():
            raise DataError(
                f"the checkpoint was written reading another dataset ({state['samples']} samples, fingerprint "
                f"{state['fingerprint']}; now {len(self.data.samples)}, {self.data.fingerprint()}): a resume must read "
                "the same data; start a new run to train on this one"
            )
        self.cursor = int(state["cursor"])
