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
from engines.trainer.batch import Batch, micro_batches, pack_batch
from engines.trainer.common import batch_logprobs, packed_logprobs
from engines.trainer.loss import k3_kl


class PolicyHistory:
    def __init__(self, model: CausalLM, keep: int):
        self.keep = keep
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = copy.deepcopy(model).eval()

    def add(self, version: int, model: CausalLM) -> None:
        self._keep(version, model.state_dict())

    def add_state(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep a publication as policy `version`; the scratch model fills in what publications leave out
        (the tied `lm_head.weight`)."""
        self.scratch.load_published(state)
        self._keep(version, self.scratch.state_dict())

    def _keep(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.states[version] = {k: v.detach().clone() for k, v in state.items()}
        for old in sorted(self.states)[: -self.keep]:
            del self.states[old]

    @torch.no_grad()
    def mismatch_kl(
        self, batch: Batch, micro_batch_size: int, pack_pad_id: int | None = None
    ) -> tuple[float | None, int]:
        """Token-mean k3 KL(sampler || same-policy trainer); None when no sample qualifies.

        With `pack_pad_id` (trainer.packing) the samples are packed first, as for the loss: same numbers,
        a fraction of the padded forward's work when lengths vary.
        """
        total, tokens = 0.0, 0.0
        for version, state in self.states.items():
            rows = torch.nonzero((batch.versions == version) & (batch.versions_end == version)).flatten()
            if len(rows) == 0:
                continue
            self.scratch.load_state_dict(state)
            selected = batch.select(rows)
            if pack_pad_id is not None:
                for pmb in micro_batches(pack_batch(selected, pack_pad_id), micro_batch_size):
                    s, n = k3_kl(packed_logprobs(self.scratch, pmb), pmb.sampler_logprobs, pmb.loss_mask)
                    total, tokens = total + s, tokens + n
                continue
            for mb in micro_batches(selected, micro_batch_size):
                s, n = k3_kl(batch_logprobs(self.scratch, mb), mb.sampler_logprobs, mb.loss_mask)
                total, tokens = total + s, tokens + n
        return (total / tokens if tokens else None), int(tokens)
