"""Batched sampling with a KV cache: the inference engine's inner loop, as a running batch.

A `Decoder` holds the rows being sampled and their KV cache. `add` prefills new rows (each distinct
prompt once: a group's samples share it) and merges them into the running batch; `sample` draws one
token for every live row; `forward` feeds those tokens through the model for the next step. Rows leave
when they end, so requests join and leave between decode steps (continuous batching, engines/inference/
engine.py); `generate` runs one fixed set of prompts to the end. Each row samples with its own seed and
counts its own tokens (engines/inference/embedded/sampling.py), so its tokens do not depend on the rest of the batch or
on when it joined. The caller passes the policy version at each `sample`, so every row records the version
that produced its first and its last completion token (in-flight weight updates happen between steps).

The cache is left-aligned per row: all rows share one cache length, a row's earlier slots are padding
(masked out) when it is shorter or joined later. Finished rows keep their slot until enough have
finished to make compaction (a cache copy) worth it; compaction also drops leading slots no live row uses.

With `record_routes` (MoE models) each completion also carries `routed_experts` [seq, layers, top_k]: the
experts every position fed through the model was routed to, seq = prompt + completion - 1 (the prompt's
prefill positions, then every completion token except the last, which is sampled but never fed back).

A vision-language model's prompts carry their images (`add(..., images)`): each distinct prompt, keyed by its
ids and its images' digests, is prefilled once with its images' encoder inputs and multimodal RoPE positions
(engines/models/vlm.py); decode is as for text. Its image token is never sampled (its logit is -inf, and the
logprobs are those of that distribution): fed back, it would stand for an image the row does not have, and the
trainer could not score it (an image token without pixels). For exact sampler/trainer parity the trainer's
logprobs need the same mask (without it, its full-vocabulary logprobs are lower by -log(1 - p(image token))).

A row whose `Sampling.prompt_logprobs` is set also gets its prompt scored from the same prefill: each prompt
token's logprob given the tokens before it (temperature 1), its rank, and the k most likely alternatives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from engines.inference.embedded.prefill import left_pad, prefill_mask, unique_prompts, vision_inputs
from engines.inference.embedded.sampling import sample, truncate_kept
from engines.models import lora
from engines.models.decoder import CausalLM
from engines.models.moe import Routing
from engines.models.vlm import HFVisionLM, is_vision


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = -1  # version that produced the first completion token
    policy_version_end: int = -1  # version that produced the last one
    finish_reason: str = "length"
    finished: bool = False
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with Sampling.top_logprobs
    routed_experts: torch.Tensor | None = None  # [seq, layers, top_k] int16, with record_routes
    # per token, with Sampling.kept_sizes: how many tokens the truncated distribution it was drawn from kept
    kept_sizes: list[int] = field(default_factory=list)
    # with Sampling.prompt_logprobs: per prompt token after the first, (logprob, rank, k alternatives)
    prompt_logprobs: list[PromptScore] | None = None
    error: Exception | None = None  # the row's own check failed (its stop check raised): its request fails


class Refused(Exception):
    """Rows that cannot join the batch (a sampling value a tensor cannot hold, a failed prefill); the batch is
    unchanged. The cause is the original error."""


# A prompt token's score: its logprob given the tokens before it, its rank (1 = the most likely), and the k most
# likely (token, logprob) at that position
PromptScore = tuple[float, int, list[tuple[int, float]]]


def prompt_scores(logits: torch.Tensor, ids: list[int], k: int) -> list[PromptScore]:
    """Scores of ids[1:] from the prefill logits at the prompt's positions ([len(ids), vocab])."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(ids[1:], dtype=torch.long)[:, None]
    chosen = logp.gather(-1, target)
    ranks = (logp > chosen).sum(-1) + 1
    alts: list[list[tuple[int, float]]] = [[] for _ in ids[1:]]
    if k:
        values, top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        alts = [list(zip(i, v, strict=True)) for i, v in zip(top.tolist(), values.tolist(), strict=True)]
    return list(zip(chosen.squeeze(-1).tolist(), ranks.tolist(), alts, strict=True))


@dataclass
class Sampling:
    """One row's sampling parameters (the n rows of a request share them, each with its own seed)."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    seed: int = 0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_tokens: int = 0  # end-of-sequence cannot be drawn before this many tokens
    ignore_eos: bool = False  # end-of-sequence does not end the row
    stop: Callable[[list[int]], bool] | None = None  # True ends the row (stop strings), given its tokens
    top_logprobs: int = 0  # also record this many most likely (token, logprob) per position
    kept_sizes: bool = False  # also record each token's kept support size (top-k / top-p truncation)
    prompt_logprobs: int | None = None  # also score the prompt's tokens, with this many alternatives each
    slot: int = 0  # a shared server's adapter slot (its tenant; engines/models/lora.py MultiLoRALinear); 0: none


class _RouteLog:
    """Per row (by origin id): the prompt's [P, layers, k] routes, then one [layers, k] per fed token."""

    def __init__(self) -> None:
        self.parts: dict[int, list[torch.Tensor]] = {}

    def prompts(self, routes: torch.Tensor, row_of: list[int], prompts: list[list[int]], origins: list[int]):
        """`routes` [unique prompts, width, layers, k] from the left-padded prefill; pads are dropped."""
        for o, u, p in zip(origins, row_of, prompts, strict=True):
            self.parts[o] = [routes[u, routes.shape[1] - len(p) :]]

    def step(self, routes: torch.Tensor, origin: list[int], fed: list[bool]) -> None:
        """`routes` [batch rows, 1, layers, k] of one decode step; only rows that fed a real token count."""
        for j, (o, real) in enumerate(zip(origin, fed, strict=True)):
            if real:
                self.parts[o].append(routes[j])

    def finish(self, origin: int, c: Completion) -> None:
        c.routed_experts = torch.cat(self.parts.pop(origin)).to(torch.int16)


@dataclass
class _Rows:
    """Per-row decode state of the rows in the batch; `origin` maps a batch row to its completion."""

    origin: torch.Tensor
    live: torch.Tensor  # False once the row has finished (its slot stays until the next compaction)
    valid: torch.Tensor  # [rows, cached positions] which cache slots hold real tokens
    next_pos: torch.Tensor
    steps: torch.Tensor  # tokens drawn so far: the position of the row's next token in its noise stream
    temps: torch.Tensor
    greedy: torch.Tensor  # temperature 0: the most likely token (its logprob at temperature 1)
    seeds: torch.Tensor
    limits: torch.Tensor
    min_tokens: torch.Tensor
    ignore_eos: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    slots: torch.Tensor  # each row's adapter slot (a shared server), which follows it through joins and compaction

    @staticmethod
    def columns(params: list[Sampling]) -> dict[str, torch.Tensor]:
        """The per-row sampling columns; raises for a value the column's dtype cannot hold."""

        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(s, name) for s in params], dtype=dtype)

        temps = col("temperature", torch.float32)
        return dict(
            temps=torch.where(temps > 0, temps, 1.0)[:, None],
            greedy=temps == 0,
            seeds=col("seed", torch.int64),
            limits=col("max_tokens", torch.int64),
            min_tokens=col("min_tokens", torch.int64),
            ignore_eos=col("ignore_eos", torch.bool),
            top_k=col("top_k", torch.int64),
            top_p=col("top_p", torch.float32),
            slots=col("slot", torch.int64),
        )

    @classmethod
    def new(cls, origins: list[int], valid: torch.Tensor, next_pos: torch.Tensor, columns: dict) -> _Rows:
        return cls(
            origin=torch.tensor(origins),
            live=torch.ones(len(origins), dtype=torch.bool),
            valid=valid,
            next_pos=next_pos,
            steps=torch.zeros(len(origins), dtype=torch.int64),
            **columns,
        )

    def select(self, rows: torch.Tensor) -> _Rows:
        return _Rows(**{k: v.index_select(0, rows) for k, v in self.__dict__.items()})

    def cat(self, other: _Rows) -> _Rows:
        """These rows then `other`'s; the shorter valid mask is padded on the left (slots before it joined)."""
        width = max(self.valid.shape[1], other.valid.shape[1])
        parts = {}
        for k, v in self.__dict__.items():
            w = getattr(other, k)
            if k == "valid":
                v, w = (F.pad(x, (width - x.shape[1], 0), value=False) for x in (v, w))
            parts[k] = torch.cat([v, w])
        return _Rows(**parts)


# Finished rows keep costing a full decode step until they leave the batch; compacting copies the cache,
# so it waits until this fraction of the batch has finished (a handful of copies per batch).
COMPACT_FRACTION = 0.125


class Decoder:
    """A running batch: rows join with `add`, draw a token per `sample`, advance with `forward`."""

    def __init__(self, model: CausalLM, eos_id: int, pad_id: int, record_routes: bool = False):
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.rows: _Rows | None = None
        self.cache: Any = None
        self.logits = torch.empty(0)  # next-token logits of every batch row
        self.tokens = torch.empty(0, dtype=torch.long)  # the tokens drawn at the last `sample`
        self.out: dict[int, Completion] = {}  # the rows still running, by origin id
        self.stops: dict[int, Callable[[list[int]], bool]] = {}
        self.log = _RouteLog() if record_routes and model.cfg.num_experts else None
        self._next_origin = 0
        self._filters = False  # some row has min_tokens, top_k or top_p: the sampler's slower path
        self.alternatives: dict[int, int] = {}  # origin -> how many top logprobs it records, for rows that do
        self.kept_rows: set[int] = set()  # origins that record their tokens' kept support sizes
        # a vision-language model's image token is never sampled (see the module docstring)
        self.image_token: int | None = cast(HFVisionLM, model).vision_spec.image_token_id if is_vision(model) else None
        self.slot_index = lora.slot_index(model)  # a shared server's model: rows pick their tenant's adapters

    @property
    def live(self) -> int:
        return len(self.out)

    @torch.no_grad()
    def add(
        self, prompts: list[list[int]], params: list[Sampling], images: list[tuple[bytes, ...]] | None = None
    ) -> list[tuple[int, Completion]]:
        """Prefill these rows and merge them into the batch; their first token is drawn at the next
        `sample`. Returns (origin id, completion) per row, filled in as the rows run. `images`: per row, the
        images (bytes, prompt order) of a vision-language model's prompt; None or empty tuples: none."""
        origins = list(range(self._next_origin, self._next_origin + len(prompts)))
        self._next_origin += len(prompts)
        try:  # nothing of the batch changes before the merge below
            columns = _Rows.columns(params)
            scored = [s.prompt_logprobs for s in params]
            logits, cache, valid, next_pos, scores = self._prefill(
                prompts, origins, max(s.max_tokens for s in params), scored, images, [s.slot for s in params]
            )
        except Exception as exc:
            if self.log:
                for o in origins:
                    self.log.parts.pop(o, None)
            raise Refused(f"{type(exc).__name__}: {exc}") from exc
        rows = _Rows.new(origins, valid, next_pos, columns)
        tokens = torch.full((len(prompts),), self.pad_id, dtype=torch.long)
        if self.rows is None:
            self.rows, self.cache, self.logits, self.tokens = rows, cache, logits, tokens
        else:
            self._compact()
            assert self.rows is not None
            length = max(self.cache.length, cache.length)
            both = self.rows.cat(rows)
            capacity = length + int((both.limits - both.steps).max())
            self.cache.realign(length - self.cache.length, capacity)
            cache.realign(length - cache.length, capacity)
            self.cache.extend(cache)
            self.rows, self.logits, self.tokens = (
                both,
                torch.cat([self.logits, logits]),
                torch.cat([self.tokens, tokens]),
            )
        self._filters |= any(s.min_tokens > 0 or s.top_k > 0 or s.top_p < 1 or s.temperature == 0 for s in params)
        made = [(o, Completion(prompt_logprobs=sc)) for o, sc in zip(origins, scores, strict=True)]
        self.out.update(made)
        self.stops.update({o: s.stop for o, s in zip(origins, params, strict=True) if s.stop is not None})
        self.alternatives.update({o: s.top_logprobs for o, s in zip(origins, params, strict=True) if s.top_logprobs})
        self.kept_rows.update(o for o, s in zip(origins, params, strict=True) if s.kept_sizes)
        return made

    def _prefill(
        self,
        prompts: list[list[int]],
        origins: list[int],
        max_tokens: int,
        scored: list[int | None],
        images: list[tuple[bytes, ...]] | None = None,
        row_slots: list[int] | None = None,
    ):
        """Prefill each distinct prompt (ids, images, adapter slot) once, then give every row its own copy of the cache.

        Returns (last-position logits per row, cache, valid mask per row, next position per row, the prompt
        scores of each row that asks for them (`scored[row]` alternatives; None: not asked)). Prompts with
        images (a vision-language model) take multimodal RoPE positions [3, B, L]; a row's next position is one
        past its largest, which runs behind its length (an image's tokens share positions).
        """
        slots = row_slots if self.slot_index is not None else None
        unique, row_of = unique_prompts(prompts, images if any(images or ()) else None, slots)
        if self.slot_index is not None and slots is not None:
            firsts = {u: slots[i] for i, u in reversed(list(enumerate(row_of)))}  # each distinct prompt's slot
            self.slot_index.set(torch.tensor([firsts[u] for u in range(len(unique))]))
        ids, valid = left_pad(unique, self.pad_id)
        cache = self.model.new_cache(len(unique), ids.shape[1] + max_tokens, next(self.model.parameters()).dtype)
        routing = Routing() if self.log else None
        vision = vision_inputs(self.model, images, row_of)
        mask = prefill_mask(valid)[:, None]
        if vision is None:
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            every = self.model(ids, positions, mask, cache, routing)
        else:
            positions = cast(HFVisionLM, self.model).mrope_positions(ids, valid, vision)
            every = self.model(ids, positions, mask, cache, routing, vision=vision)
            positions = positions[0]
        logits = every[:, -1]
        if self.log and routing:
            self.log.prompts(routing.stacked(), row_of, prompts, origins)
        width, by_prompt = ids.shape[1], {}
        scores: list[list[PromptScore] | None] = []
        for u, p, k in zip(row_of, prompts, scored, strict=True):
            if k is not None and (u, k) not in by_prompt:  # the samples of one prompt share its scores
                by_prompt[u, k] = prompt_scores(every[u, width - len(p) :], p, k)
            scores.append(None if k is None else by_prompt[u, k])
        expand = torch.tensor(row_of, dtype=torch.long)
        if len(unique) < len(prompts):
            cache.select_rows(expand)
        return logits[expand], cache, valid[expand], positions[expand, -1] + 1, scores

    def _distribution(self, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, vocab] log-probabilities each row draws from: temperature, then (rows that ask for them)
        min_tokens' end-of-sequence mask and top-k / top-p truncation. Also, when truncation ran or some
        row records kept sizes, each row's count of tokens with non-zero probability ([rows]); else None."""
        scaled = self.logits.float() / rows.temps
        if self.image_token is not None:  # a sampled image token would be fed back as an image with no pixels
            scaled[:, self.image_token] = float("-inf")
        if self._filters and self.eos_id >= 0:
            scaled[:, self.eos_id] = scaled[:, self.eos_id].masked_fill(rows.steps < rows.min_tokens, float("-inf"))
        logp = torch.log_softmax(scaled, dim=-1)
        kept = None
        if self._filters and bool((rows.top_k > 0).any() or (rows.top_p < 1).any()):
            logp, kept = truncate_kept(logp, rows.top_k, rows.top_p)
        elif self.kept_rows:
            kept = logp.isfinite().sum(-1)
        return logp, kept

    @torch.no_grad()
    def sample(self, version: int, slot_versions: dict[int, int] | None = None) -> list[int]:
        """Draw one token for every live row with the logits `version` produced (a row of adapter slot s > 0: the
        logits its tenant's version `slot_versions[s]` produced); returns their origins.

        Rows that end (end-of-sequence, their token limit, a stop) are marked finished and leave the batch.
        """
        rows = self.rows
        assert rows is not None
        logp, kept = self._distribution(rows)
        tokens = sample(logp, rows.seeds, rows.steps)  # noise depends on (seed, row's own step) only
        if self._filters and bool(rows.greedy.any()):
            tokens = torch.where(rows.greedy, logp.argmax(-1), tokens)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        eos = (tokens == self.eos_id) & ~rows.ignore_eos
        full = rows.steps + 1 >= rows.limits
        alts = None
        if self.alternatives:  # one topk for the batch, only while some row asks for it
            values, ids = logp.topk(min(max(self.alternatives.values()), logp.shape[-1]), dim=-1)
            alts = list(zip(ids.tolist(), values.tolist(), strict=True))
        sizes = kept.tolist() if kept is not None and self.kept_rows else None
        versions = [version] * len(tokens)
        if slot_versions:
            versions = [slot_versions.get(s, version) if s else version for s in rows.slots.tolist()]
        stepped = self._record(tokens.tolist(), chosen.tolist(), eos.tolist(), full.tolist(), versions, alts, sizes)
        rows.steps += 1
        self.tokens = tokens
        self._end([o for o in stepped if self.out[o].finished])
        return stepped

    def drop(self, origins: list[int]) -> None:
        """End these running rows now (their request was aborted): finish reason "abort", tokens so far."""
        for o in origins:
            self.out[o].finished, self.out[o].finish_reason = True, "abort"
        self._end(origins)

    def _end(self, ended: list[int]) -> None:
        """Take finished rows out of the batch (their slots stay until the next compaction)."""
        rows = self.rows
        if not ended or rows is None:
            return
        rows.live &= ~torch.isin(rows.origin, torch.tensor(ended, dtype=rows.origin.dtype))
        for o in ended:
            c = self.out.pop(o)
            self.stops.pop(o, None)
            self.alternatives.pop(o, None)
            self.kept_rows.discard(o)
            if self.log:
                self.log.finish(o, c)
        if not self.out:
            self.rows, self.cache, self._filters = None, None, False  # the batch is empty: free its cache
        elif (~rows.live).sum() >= max(1, COMPACT_FRACTION * len(rows.live)):
            self._compact()

    def _record(
        self,
        tokens: list[int],
        logprobs: list[float],
        eos: list[bool],
        full: list[bool],
        versions: list[int],
        alts,
        kept: list[int] | None = None,
    ):
        """Append this step's token to every live row's completion (plain Python lists: no tensor indexing);
        returns the origins that got one. A row ends at end-of-sequence or a stop ("stop"), or full ("length")."""
        assert self.rows is not None
        stepped = []
        origins, lives = self.rows.origin.tolist(), self.rows.live.tolist()
        rows = zip(origins, lives, tokens, logprobs, eos, full, versions, strict=True)
        for j, (origin, live, token, lp, is_eos, is_full, version) in enumerate(rows):
            if not live:
                continue
            c = self.out[origin]
            c.token_ids.append(token)
            c.logprobs.append(lp)
            if alts is not None and (k := self.alternatives.get(origin)):
                # tokens the row's truncation removed (logprob -inf) are no alternatives (nor valid JSON)
                pairs = zip(alts[j][0][:k], alts[j][1][:k], strict=True)
                c.top_logprobs.append([(t, v) for t, v in pairs if v > float("-inf")])
            if kept is not None and origin in self.kept_rows:
                c.kept_sizes.append(kept[j])
            if c.policy_version < 0:
                c.policy_version = version
            c.policy_version_end = version
            if is_eos or self._stopped(origin, c):
                c.finished, c.finish_reason = True, "stop"
            elif is_full:
                c.finished, c.finish_reason = True, "length"
            stepped.append(origin)
        return stepped

    def _stopped(self, origin: int, c: Completion) -> bool:
        """The row's stop check; one that raises ends the row with the error (its request alone fails)."""
        stop = self.stops.get(origin)
        try:
            return stop is not None and stop(c.token_ids)
        except Exception as exc:
            c.error = exc
            return True

    @torch.no_grad()
    def forward(self) -> None:
        """Feed the tokens drawn at the last `sample` through the model: the next step's logits."""
        rows = self.rows
        assert rows is not None
        rows.valid = torch.cat([rows.valid, rows.live[:, None]], dim=1)
        step_ids = torch.where(rows.live, self.tokens, self.pad_id)[:, None]
        mask = rows.valid.clone()
        mask[:, -1] = True  # finished rows attend to their own pad token: harmless, never NaN
        routing = Routing() if self.log else None
        if self.slot_index is not None:
            self.slot_index.set(rows.slots)
        self.logits = self.model(step_ids, rows.next_pos[:, None], mask[:, None, None, :], self.cache, routing)[:, -1]
        if self.log and routing:
            self.log.step(routing.stacked(), rows.origin.tolist(), rows.live.tolist())
        rows.next_pos = rows.next_pos + 1

    def _compact(self) -> None:
        """Drop finished rows from the batch and its cache, and leading slots that no live row uses."""
        rows = self.rows
        assert rows is not None
        if bool(rows.live.all()):
            return
        keep = torch.nonzero(rows.live).flatten()
        self.rows, self.tokens, self.logits = rows.select(keep), self.tokens[keep], self.logits[keep]
        self.cache.select_rows(keep)
        lead = int(self.rows.valid.any(0).int().argmax())  # first slot some live row uses
        if lead > 0:
            self.rows.valid = self.rows.valid[:, lead:]
            self.cache.realign(-lead, self.cache.length - lead + int((self.rows.limits - self.rows.steps).max()))


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: list[int],
    temperatures: list[float],
    eos_id: int,
    pad_id: int,
    seeds: list[int],
    between_steps: Callable[[], int] = lambda: 0,
    record_routes: bool = False,
) -> list[Completion]:
    """Sample every prompt to its end in one batch; `between_steps()` runs before each forward (weight
    updates) and returns the policy version it serves."""
    decoder = Decoder(model, eos_id, pad_id, record_routes)
    params = [
        Sampling(max_tokens=m, temperature=t, seed=s)
        for m, t, s in zip(max_new_tokens, temperatures, seeds, strict=True)
    ]
    version = between_steps()  # the version whose forward produces the logits sampled next
    made = decoder.add(prompts, params)
    while True:
        decoder.sample(version)
        if not decoder.live:
            break
        version = between_steps()
        decoder.forward()
    return [c for _, c in made]
