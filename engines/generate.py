"""Batched sampling with a KV cache: the inference engine's inner loop.

Prompts are left-padded into one batch; prefill runs once, then one decode step per token. Between decode
steps `between_steps()` may swap the weights (in-flight update) and returns the current policy version,
so each sequence records the version that produced its first and its last completion token. Each row
samples with its own seed (engines/sampling.py), so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engines.model import CausalLM, KVCache
from engines.sampling import sample


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = -1  # version that produced the first completion token
    policy_version_end: int = -1  # version that produced the last one
    finish_reason: str = "length"


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
) -> list[Completion]:
    ids, valid = _left_pad(prompts, pad_id)
    batch, width = ids.shape
    temps = torch.tensor(temperatures, dtype=torch.float32)[:, None]
    cache = KVCache.empty(model.cfg, batch, width + max(max_new_tokens), next(model.parameters()).dtype)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    version = between_steps()  # the version whose forward produces the logits sampled next
    logits = model(ids, positions, _prefill_mask(valid)[:, None], cache)[:, -1]
    next_pos = positions[:, -1] + 1
    out = [Completion() for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool)
    row_seeds = torch.tensor(seeds, dtype=torch.int64)
    for t in range(max(max_new_tokens)):
        logp = torch.log_softmax(logits.float() / temps, dim=-1)
        tokens = sample(logp, row_seeds, t)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for i in torch.nonzero(~done).flatten().tolist():
            c = out[i]
            c.token_ids.append(int(tokens[i]))
            c.logprobs.append(float(chosen[i]))
            if c.policy_version < 0:
                c.policy_version = version
            c.policy_version_end = version
            if tokens[i] == eos_id:
                c.finish_reason, done[i] = "stop", True
            elif len(c.token_ids) >= max_new_tokens[i]:
                done[i] = True
        if bool(done.all()):
            break
        valid = torch.cat([valid, ~done[:, None]], dim=1)
        step_ids = torch.where(done, pad_id, tokens)[:, None]
        mask = valid.clone()
        mask[:, -1] = True  # finished rows attend to their own pad token: harmless, never NaN
        version = between_steps()
        logits = model(step_ids, next_pos[:, None], mask[:, None, None, :], cache)[:, -1]
        next_pos = next_pos + 1
    return out
