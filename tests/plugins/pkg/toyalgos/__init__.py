"""An algorithm package that is not part of rollflow (tests/plugins/README.md): `RANK`, a rank-based advantage
estimator with a typed parameter, registered as the `rollflow.advantages` entry point `rank` by the dist-info
tests/algo_fixture.py writes, and the bad plugins the load-time check must refuse."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engines.orchestrator.advantages import AdvantageSpec


class RankParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: float = Field(1.0, gt=0, description="the advantage of the best sample in a group")


def ranks(groups: list[list[float]], params: RankParams) -> list[list[float]]:
    """Each reward's rank in its group (ties share their mean rank), centred and scaled to [-scale, scale]."""
    out = []
    for rewards in groups:
        order = sorted(rewards)
        mean_rank = [(order.index(r) + len(order) - 1 - order[::-1].index(r)) / 2 for r in rewards]
        top = (len(rewards) - 1) / 2
        out.append([params.scale * (m - top) / top for m in mean_rank])
    return out


RANK = AdvantageSpec(ranks, RankParams)


class Specs:
    rank = RANK  # reached by a dotted import path: toyalgos:Specs.rank


NOT_A_SPEC = ranks  # a bare function: not an AdvantageSpec
NO_PARAMS_CLASS = AdvantageSpec(ranks, dict)  # type: ignore[arg-type]
SHORT = AdvantageSpec(lambda groups, params: [g[1:] for g in groups], RankParams)
NOT_FINITE = AdvantageSpec(lambda groups, params: [[float("nan")] * len(g) for g in groups], RankParams)
RAISES = AdvantageSpec(lambda groups, params: 1 / 0, RankParams)
