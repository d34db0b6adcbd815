"""Batched sampling with a KV cache: the inference engine's inner loop.

Prompts are left-padded into one batch; prefill runs once, then one decode step per token. Between decode
steps `between_steps()` may swap the weights (in-flight update) and returns the current policy version,
so each sequence records the version that produced its first and its last completion token. Each row
samples with its own seed (engines/sampling.py), so its tokens do not depend on the rest of the batch.

Two savings that matter for RL batches (docs/benchmarks.md, benchmark 2): identical prompts (a group's
samples) are prefilled once and their cache rows copied, and finished rows leave the batch (the cache is
compacted once enough have finished) instead of decoding padding until the longest row ends.

With `record_routes` (MoE models) each completion also carries `routed_experts` [seq, layers, top_k]: the
experts every position fed through the model was routed to, seq = prompt + completion - 1 (the prompt's
prefill positions, then every completion token except the last, which is sampled but never fed back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engines.model import CausalLM
from engines.moe import Routing
from engines.sampling import sample


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = -1  # version that produced the first completion token
    policy_version_end: int = -1  # version that produced the last one
    finish_reason: str = "length"
    routed_experts: torch.Tensor | None = None  # [seq, layers, top_k] int16, with record_routes


class _RouteLog:
    """Per request row: the prompt's [P, layers, k] routes, then one [layers, k] per fed completion token."""

    def __init__(self, rows: int):
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(rows)]

    def prompts(self, routes: torch.Tensor, row_of: list[int], prompts: list[list[int]]) -> None:
        """`routes` [unique prompts, width, layers, k] from the left-padded prefill; pads are dropped."""
        for i, (u, p) in enumerate(zip(row_of, prompts, strict=True)):
            self.parts[i].append(routes[u, routes.shape[1] - len(p) :])

    def step(self, routes: torch.Tensor, origin: list[int], fed: list[bool]) -> None:
        """`routes` [batch rows, 1, layers, k] of one decode step; only rows that fed a real token count."""
        for j, (o, real) in enumerate(zip(origin, fed, strict=True)):
            if real:
                self.parts[o].append(routes[j])

    def finish(self, out: list[Completion]) -> None:
        for c, parts in zip(out, self.parts, strict=True):
            c.routed_experts = torch.cat(parts).to(torch.int16)


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p) :] = True
    return ids, valid


def _prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    # Each query also sees itself so pad rows never softmax over an empty set (which would give NaN).
    return (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)


def _unique_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Distinct prompts in first-seen order, and each row's index among them."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    return [list(k) for k in index], rows


@dataclass
class _Rows:
    """Per-row decode state of the rows still in the batch; `origin` maps a batch row to its request row."""

    origin: torch.Tensor
    live: torch.Tensor  # False once the row has finished (its slot stays until the next compaction)
    valid: torch.Tensor  # [rows, cached positions] which cache slots hold real tokens
    next_pos: torch.Tensor
    temps: torch.Tensor
    seeds: torch.Tensor
    limits: torch.Tensor

    def select(self, rows: torch.Tensor) -> _Rows:
        return _Rows(**{k: v.index_select(0, rows) for k, v in self.__dict__.items()})


def _prefill(model: CausalLM, prompts: list[list[int]], pad_id: int, capacity: int, log: _RouteLog | None):
    """Prefill each distinct prompt once, then give every row its own copy of the cache.

    The rows of a group share their prompt, so a batch of G samples per prompt does 1/G of the prefill.
    Returns (last-position logits per row, cache, valid mask per row, next position per row).
    """
    unique, row_of = _unique_prompts(prompts)
    ids, valid = _left_pad(unique, pad_id)
    cache = model.new_cache(len(unique), capacity, next(model.parameters()).dtype)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    routing = Routing() if log else None
    logits = model(ids, positions, _prefill_mask(valid)[:, None], cache, routing)[:, -1]
    if log and routing:
        log.prompts(routing.stacked(), row_of, prompts)
    expand = torch.tensor(row_of, dtype=torch.long)
    if len(unique) < len(prompts):
        cache.select_rows(expand)
    return logits[expand], cache, valid[expand], positions[expand, -1] + 1


# Finished rows keep costing a full decode step until they leave the batch; compacting copies the cache,
# so it waits until this fraction of the batch has finished (a handful of copies per batch).
COMPACT_FRACTION = 0.125


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
    batch = len(prompts)
    capacity = max(len(p) for p in prompts) + max(max_new_tokens)
    log = _RouteLog(batch) if record_routes and model.cfg.num_experts else None
    version = between_steps()  # the version whose forward produces the logits sampled next
    logits, cache, valid, next_pos = _prefill(model, prompts, pad_id, capacity, log)
    rows = _Rows(
        origin=torch.arange(batch),
        live=torch.ones(batch, dtype=torch.bool),
        valid=valid,
        next_pos=next_pos,
        temps=torch.tensor(temperatures, dtype=torch.float32)[:, None],
        seeds=torch.tensor(seeds, dtype=torch.int64),
        limits=torch.tensor(max_new_tokens),
    )
    out = [Completion() for _ in range(batch)]
    for t in range(max(max_new_tokens)):
        logp = torch.log_softmax(logits.float() / rows.temps, dim=-1)
        tokens = sample(logp, rows.seeds, t)  # noise depends on (seed, t) only: compaction changes nothing
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        _record(out, rows, tokens.tolist(), chosen.tolist(), version, eos_id)
        rows.live &= (tokens != eos_id) & (rows.limits > t + 1)
        if not bool(rows.live.any()):
            break
        if (~rows.live).sum() >= max(1, COMPACT_FRACTION * len(rows.live)):
            keep = torch.nonzero(rows.live).flatten()
            rows, tokens = rows.select(keep), tokens.index_select(0, keep)
            cache.select_rows(keep)
        rows.valid = torch.cat([rows.valid, rows.live[:, None]], dim=1)
        step_ids = torch.where(rows.live, tokens, pad_id)[:, None]
        mask = rows.valid.clone()
        mask[:, -1] = True  # finished rows attend to their own pad token: harmless, never NaN
        version = between_steps()
        routing = Routing() if log else None
        logits = model(step_ids, rows.next_pos[:, None], mask[:, None, None, :], cache, routing)[:, -1]
        if log and routing:
            log.step(routing.stacked(), rows.origin.tolist(), rows.live.tolist())
        rows.next_pos = rows.next_pos + 1
    if log:
        log.finish(out)
    return out


def _record(out: list[Completion], rows: _Rows, tokens: list[int], logprobs: list[float], version: int, eos: int):
    """Append this step's token to every live row's completion (plain Python lists: no tensor indexing)."""
    for origin, live, token, lp in zip(rows.origin.tolist(), rows.live.tolist(), tokens, logprobs, strict=True):
        if not live:
            continue
        c = out[origin]
        c.token_ids.append(token)
        c.logprobs.append(lp)
        if c.policy_version < 0:
            c.policy_version = version
        c.policy_version_end = version
        if token == eos:
            c.finish_reason = "stop"
