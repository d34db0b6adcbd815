"""The trainer's policy loss, as a profile picks it: `[trainer.loss] type = ...` with that variant's own typed
parameters, the settings every variant shares (aggregation, entropy bonus, zero-advantage samples), and the
frozen reference policy's KL penalty (`[trainer.reference]`).

A built-in `type` selects one of the parameter models below (docs/algorithm.md gives each formula and
source); any other `type` names a plugin, an entry point in the `rollflow.losses` group or an import path
`module:attribute`, whose parameters go under `args` and are validated by the plugin's own model when the
run loads (engines/trainer/losses/registry.py). Pure pydantic: no torch here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from config.base import Strict
from config.registry import is_plugin_name

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
OldPolicy = Literal["sampler", "proximal"]


class LossCommon(Strict):
    """What every variant shares: how per-token terms become the step's loss, and what joins them."""

    type: str  # each variant's name (a Literal with its default there); a plugin's entry point or import path
    aggregation: Aggregation = Field(
        "token_mean",
        description="token_mean: sum over the optimizer step's tokens / their count; sequence_mean: mean over "
        "samples of each sample's token mean (GRPO); constant: sum / (samples x constant_tokens) (Dr. GRPO)",
    )
    constant_tokens: int | None = Field(None, gt=0, description="the normaliser's tokens per sample (constant)")
    entropy_coef: float = Field(0.0, ge=0, description="subtracts coef x aggregated entropy (an entropy bonus)")
    zero_advantage: Literal["keep", "filter"] = Field(
        "keep",
        description="samples of groups whose advantages are all 0: keep (they count in the normaliser) or "
        "filter (left out of the loss and the normaliser); counted either way",
    )

    @model_validator(mode="after")
    def _constant_needs_tokens(self) -> LossCommon:
        if self.aggregation == "constant" and self.constant_tokens is None:
            raise ValueError("aggregation = 'constant' needs constant_tokens (e.g. orchestrator.max_new_tokens)")
        if self.aggregation != "constant" and self.constant_tokens is not None:
            raise ValueError(f"constant_tokens is read only with aggregation = 'constant' (not {self.aggregation!r})")
        return self


class MaskedISLoss(LossCommon):
    """Token importance ratio against the sampler, tokens outside [mask_low, mask_high] dropped (the default)."""

    type: Literal["masked_is"] = "masked_is"
    mask_low: float = Field(0.5, gt=0, lt=1)
    mask_high: float = Field(2.0, gt=1)


class PPOClipLoss(LossCommon):
    """PPO's clipped surrogate; against the proximal policy it is decoupled PPO (behaviour weight capped)."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, gt=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.2, gt=0, description="ratio clipped above at 1 + clip_high (DAPO: clip-higher)")
    old_policy: OldPolicy = Field("sampler", description="the policy the ratio is taken against")
    behaviour_cap: float = Field(2.0, gt=1, description="old_policy = proximal: cap on proximal / sampler")


class TISLoss(LossCommon):
    """Token-level truncated importance sampling: weight min(ratio, cap), no tokens dropped."""

    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=1)


class MISLoss(LossCommon):
    """Sequence-level masked IS: the geometric-mean ratio of a sample weights it, samples outside dropped."""

    type: Literal["mis"] = "mis"
    mask_low: float = Field(0.5, gt=0, lt=1)
    mask_high: float = Field(2.0, gt=1)


class IcePopLoss(LossCommon):
    """IcePop: tokens whose ratio leaves [mask_low, mask_high] dropped, PPO clipping on the kept ones."""

    type: Literal["icepop"] = "icepop"
    mask_low: float = Field(0.5, gt=0, lt=1)
    mask_high: float = Field(5.0, gt=1)
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.2, gt=0)
    old_policy: OldPolicy = "sampler"


class CISPOLoss(LossCommon):
    """CISPO: the importance weight clipped and stopped from the gradient, times the logprob; no token dropped."""

    type: Literal["cispo"] = "cispo"
    ratio_max: float = Field(5.0, gt=1)
    ratio_min: float = Field(0.0, ge=0, lt=1)
    old_policy: OldPolicy = "sampler"
    behaviour_cap: float = Field(2.0, gt=1)


class GSPOLoss(LossCommon):
    """GSPO: PPO clipping of the length-normalised sequence ratio."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, gt=0, lt=1)
    clip_high: float = Field(4e-4, gt=0)
    old_policy: OldPolicy = "sampler"
    behaviour_cap: float = Field(2.0, gt=1)


class IPOLoss(LossCommon):
    """prime-rl's IPO: tokens whose probability moved more than `threshold` dropped, plus a squared log-ratio."""

    type: Literal["ipo"] = "ipo"
    threshold: float = Field(0.1, gt=0, le=1, description="|p_trainer - p_sampler| above it: token dropped")
    adv_tau: float = Field(1.0, gt=0)
    kl_tau: float = Field(1e-3, ge=0)


class PluginLoss(LossCommon):
    """A loss brought by a package: an entry point in `rollflow.losses` or an import path `module:attribute`."""

    type: str
    args: dict[str, Any] = Field(default_factory=dict, description="the plugin's parameters")

    @model_validator(mode="after")
    def _type_syntax(self) -> PluginLoss:
        if is_plugin_name(self.type):
            return self
        raise ValueError(
            f"loss type {self.type!r} is neither a built-in ({', '.join(BUILTIN_LOSSES)}), an entry point "
            "name in 'rollflow.losses', nor an import path `module:attribute`"
        )


BUILTIN_LOSSES: dict[str, type[LossCommon]] = {
    m.model_fields["type"].default: m
    for m in (MaskedISLoss, PPOClipLoss, TISLoss, MISLoss, IcePopLoss, CISPOLoss, GSPOLoss, IPOLoss)
}
# variants whose formula reads a whole sample at once (they need each sample's tokens on one rank)
SEQUENCE_LEVEL = frozenset({"mis", "gspo"})


def _variant(data: Any) -> str:
    kind = data.get("type", "masked_is") if isinstance(data, dict) else getattr(data, "type", "masked_is")
    return kind if kind in BUILTIN_LOSSES else "plugin"


LossConfig = Annotated[
    Annotated[MaskedISLoss, Tag("masked_is")]
    | Annotated[PPOClipLoss, Tag("ppo_clip")]
    | Annotated[TISLoss, Tag("tis")]
    | Annotated[MISLoss, Tag("mis")]
    | Annotated[IcePopLoss, Tag("icepop")]
    | Annotated[CISPOLoss, Tag("cispo")]
    | Annotated[GSPOLoss, Tag("gspo")]
    | Annotated[IPOLoss, Tag("ipo")]
    | Annotated[PluginLoss, Tag("plugin")],
    Discriminator(_variant),
]


def uses_proximal(loss: LossCommon) -> bool:
    """Whether the variant's ratio is taken against the proximal policy (the trainer's at the step's start)."""
    return getattr(loss, "old_policy", "sampler") == "proximal"


def sequence_level(loss: LossCommon) -> bool:
    """Whether the loss needs every token of a sample together (a sequence-level ratio or mean)."""
    return loss.type in SEQUENCE_LEVEL or loss.aggregation == "sequence_mean"


class ReferenceConfig(Strict):
    """A KL penalty to a frozen reference policy, computed by the trainer itself (no second process)."""

    kl_coef: float = Field(0.0, ge=0, description="adds coef x aggregated KL(policy || reference); 0: off")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Schulman's estimators of the KL per token")
    model: str | None = Field(
        None, description="a model directory (as model.path); default: policy version 0 (the run's start)"
    )

    @model_validator(mode="after")
    def _model_needs_coef(self) -> ReferenceConfig:
        if self.model is not None and self.kl_coef == 0:
            raise ValueError("reference.model is read only with reference.kl_coef > 0")
        return self

    @property
    def enabled(self) -> bool:
        return self.kl_coef > 0
