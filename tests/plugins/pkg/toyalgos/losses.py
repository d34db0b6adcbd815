"""A policy loss that is not part of rollflow: `SIGN`, REINFORCE on the sign of the advantage (a typed `scale`),
registered as the `rollflow.losses` entry point `sign` by the dist-info tests/algo_fixture.py writes, with the
bad plugins the load-time check must refuse."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from engines.trainer.losses.base import LossInputs, LossSpec, LossTerms, masked


class SignParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: float = Field(1.0, gt=0, description="the weight of every token of a positive-advantage sample")


def sign_pg(x: LossInputs, p: SignParams) -> LossTerms:
    """term = -scale * sign(A) * exp(l - sg(l)): gradient -scale * sign(A) * grad l, value -scale * sign(A)."""
    policy = torch.exp(x.logprobs - x.logprobs.detach())
    sign = torch.sign(x.advantages)
    return LossTerms(
        per_token=masked(-p.scale * sign * policy, x.mask),
        ratio=masked(torch.exp(x.logprobs - x.sampler_logprobs).detach(), x.mask),
        dropped=x.mask & (sign == 0),
        clipped=torch.zeros_like(x.mask),
        metrics={"positive": (sign > 0).to(x.logprobs.dtype)},
    )


SIGN = LossSpec(fn=sign_pg, params=SignParams)


class Specs:
    sign = SIGN  # reached by a dotted import path: toyalgos.losses:Specs.sign


NOT_A_SPEC = sign_pg  # a bare function: not a LossSpec
NO_PARAMS_CLASS = LossSpec(fn=sign_pg, params=dict)  # type: ignore[arg-type]
WRONG_SHAPE = LossSpec(fn=lambda x, p: LossTerms(x.logprobs[:, :1], x.mask, x.mask, x.mask), params=SignParams)
NOT_FINITE = LossSpec(
    fn=lambda x, p: LossTerms(x.logprobs * float("nan"), x.mask.float(), x.mask, x.mask), params=SignParams
)
RAISES = LossSpec(fn=lambda x, p: 1 / 0, params=SignParams)
