"""mismatch_kl: trainer vs sampler logprobs on the *same* policy.

A sample trained at step s was drawn by policy `policy_version` <= s-1, so comparing it with the
trainer's current weights mixes policy drift into the number. `PolicyHistory` keeps the last few
policies (CPU copies; memory = params x versions kept, fine at small scale and switchable off) so each
sample is scored by exactly the weights that sampled it. Samples that span an in-flight weight update
(policy_version != policy_version_end) have no single sampling policy and are left out.

For MoE batches it also counts the scored tokens whose top-k expert set, chosen by the trainer's own
router, differs from the sampler's in any layer; with router replay the forward uses the sampler's
experts (as the loss does), so the KL then measures everything but the routing decision.

With top-k / top-p sampling the trainer's logprobs are taken on the support the sampler kept (`batch.kept`,
trainer.keep_sampling_mask), as the loss takes them, so the metric measures what the loss sees.

A vision-language policy's batch also gets the KL per number of images in the sample (`by_images`, reported
as `mismatch_kl/images=K` for each K present, 0 for text samples): the seed expects a higher mismatch with
several images (the sampler's and trainer's image processing differ slightly); this measures it.
"""

from __future__ import annotations

import copy
import hashlib
import math
from typing import NamedTuple

import torch

from engines.models.decoder import CausalLM
from engines.models.moe import Routing
from engines.trainer.batch import Batch, PackedBatch
from engines.trainer.common import expert_disagreement, forward_precision, routing_for, train_logprobs
from engines.trainer.layout import Layout
from engines.trainer.losses.kl import k3_kl


class Mismatch(NamedTuple):
    kl: float | None  # token-mean k3 KL(sampler || same-policy trainer); None when no sample qualifies
    tokens: int
    expert_mismatch: float | None  # fraction of scored MoE tokens routed to another top-k set; None if dense
    by_images: dict[int, float] | None = None  # images per sample -> its samples' KL (vision-language batches)


class MismatchSums:
    """The metric's running sums over micro-batches scored by the policy that sampled them: whichever forward
    gave the logprobs (the history's scratch model, or the trainer's own before its first optimizer step).
    `weight` scales a sampled subset's sums up to the rows it stands for (`stale_sample`)."""

    def __init__(self) -> None:
        self.sums = [0.0, 0.0, 0.0, 0.0]  # kl, kl tokens, tokens with other experts, routed tokens
        self.per_images: dict[int, list[float]] = {}  # images per sample -> [kl, kl tokens]

    def add(
        self,
        mb: Batch | PackedBatch,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        routing: Routing | None,
        weight: float = 1.0,
    ) -> None:
        """Add `mb`'s tokens in `mask` (aligned with `mb.loss_mask`), scored as `logprobs` with `routing`."""
        kl = k3_kl(logprobs, mb.sampler_logprobs, mask)
        for i, v in enumerate((*kl, *expert_disagreement(routing, mb, mask))):
            self.sums[i] += v * weight
        if isinstance(mb, Batch) and mb.image_counts is not None:
            _add_by_images(self.per_images, mb, logprobs, mask, weight)

    def result(self) -> Mismatch:
        s = self.sums
        kl_mean = s[0] / s[1] if s[1] else None
        per_images = self.per_images
        by_images = {k: t / n for k, (t, n) in sorted(per_images.items()) if n} if per_images else None
        return Mismatch(kl_mean, round(s[1]), s[2] / s[3] if s[3] else None, by_images)


def stale_sample(ids: list[str], rows: torch.Tensor, fraction: float, step: int) -> tuple[torch.Tensor, float]:
    """(the rows of `rows` measured, the weight each stands for): the ceil(fraction x n) rows whose sample id
    hashes lowest at this step (deterministic per step and id, a different subset every step); all at 1.0."""
    n = len(rows)
    take = min(n, math.ceil(fraction * n))
    if take >= n:
        return rows, 1.0
    keys = [hashlib.blake2b(f"{step}/{ids[int(r)]}".encode(), digest_size=8).digest() for r in rows]
    order = sorted(range(n), key=keys.__getitem__)[:take]
    return rows[sorted(order)], n / take


class PolicyHistory:
    def __init__(self, model: CausalLM, keep: int, compute_dtype: str = "float32"):
        self.keep, self.compute_dtype = keep, compute_dtype  # trainer.compute_dtype: its forwards' precision
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

    def qualifying(self, batch: Batch) -> torch.Tensor:
        """[B] bool: the rows drawn by one kept policy (policy_version = policy_version_end, held here)."""
        held = torch.tensor(sorted(self.states), dtype=batch.versions.dtype)
        return (batch.versions == batch.versions_end) & torch.isin(batch.versions, held)

    def mismatch_kl(self, batch: Batch, layout: Layout, replay: bool = False) -> Mismatch:
        """KL and expert disagreement of the samples drawn by one kept policy (see the module docstring).

        The samples are cut into forwards as the loss's are (`layout`: padded, packed or sharing prompts): the
        same numbers, a fraction of the padded forward's work when lengths vary or prompts repeat. `replay`:
        router replay, as the loss.
        """
        sums = MismatchSums()
        self.score(sums, batch, torch.ones(len(batch), dtype=torch.bool), layout, replay)
        return sums.result()

    @torch.no_grad()
    def score(
        self,
        into: MismatchSums,
        batch: Batch,
        rows: torch.Tensor,
        layout: Layout,
        replay: bool = False,
        weight: float = 1.0,
    ) -> None:
        """Add the qualifying rows among `rows` ([B] bool), each scored by the kept policy that sampled it."""
        for version, state in self.states.items():
            picked = rows & (batch.versions == version) & (batch.versions_end == version)
            if not bool(picked.any()):
                continue
            self.scratch.load_state_dict(state)
            selected = batch.select(torch.nonzero(picked).flatten())
            for mb in layout.split(selected):
                routing = routing_for(mb, replay)
                with forward_precision(self.scratch, self.compute_dtype):
                    logprobs = train_logprobs(self.scratch, mb, routing)
                into.add(mb, logprobs, mb.loss_mask, routing, weight)


def _add_by_images(
    into: dict[int, list[float]], mb: Batch, logprobs: torch.Tensor, mask: torch.Tensor, weight: float
) -> None:
    """Add the micro-batch's KL sums and token counts to `into`, grouped by the samples' image counts."""
    assert mb.image_counts is not None
    for k in mb.image_counts.unique().tolist():
        rows = mb.image_counts == k
        total, tokens = k3_kl(logprobs[rows], mb.sampler_logprobs[rows], mask[rows])
        acc = into.setdefault(int(k), [0.0, 0.0])
        acc[0] += total * weight
        acc[1] += tokens * weight
