"""mismatch_kl: trainer vs sampler logprobs on the *same* policy.

A sample trained at step s was drawn by policy `policy_version` <= s-1, so comparing it with the
trainer's current weights mixes policy drift into the number. `PolicyHistory` keeps the last few
policies (CPU copies; memory = params x versions kept, fine at small scale and switchable off) so each
sample is scored by exactly the weights that sampled it. Samples that span an in-flight weight update
(policy_version != policy_version_end) have no single sampling policy and are left out.
"""

from __future__ import annotations

import copy

import torch

from engines.model import CausalLM
from engines.trainer.batch import Batch, micro_batches
from engines.trainer.common import batch_logprobs
from engines.trainer.loss import k3_kl


class PolicyHistory:
    def __init__(self, model: CausalLM, keep: int):
        self.keep = keep
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = copy.deepcopy(model).eval()

    def add(self, version: int, model: CausalLM) -> None:
        self.add_state(version, model.state_dict())

    def add_state(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `state` (a full state dict or a publication) as policy `version`."""
        self.scratch.load_published(state)
        self.states[version] = {k: v.detach().clone() for k, v in self.scratch.state_dict().items()}
        for old in sorted(self.states)[: -self.keep]:
            del self.states[old]

    @torch.no_grad()
    def mismatch_kl(self, batch: Batch, micro_batch_size: int) -> tuple[float | None, int]:
        """Token-mean k3 KL(sampler || same-policy trainer); None when no sample qualifies."""
        total, tokens = 0.0, 0.0
        for version, state in self.states.items():
            rows = torch.nonzero((batch.versions == version) & (batch.versions_end == version)).flatten()
            if len(rows) == 0:
                continue
            self.scratch.load_state_dict(state)
            for mb in micro_batches(batch.select(rows), micro_batch_size):
                s, n = k3_kl(batch_logprobs(self.scratch, mb), mb.sampler_logprobs, mb.loss_mask)
                total, tokens = total + s, tokens + n
        return (total / tokens if tokens else None), int(tokens)
