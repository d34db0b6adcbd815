"""Vision-language models (Qwen3-VL) behind rollflow's model interface: transformers' own modeling.

`HFVisionLM` is `HFCausalLM` (engines/models/hf.py) plus images: `forward(ids, positions, mask, cache, routing,
vision)` takes the batch's `VisionInputs` (engines/models/vision.py: the pixel patches of every image of the
batch, in row order, then prompt order) for the rows whose ids carry image tokens, and positions either as
text positions [B, L] (broadcast to the three multimodal RoPE rows: what cached decode passes, where every
new token is text) or as multimodal RoPE positions [3, B, L] (temporal, height, width).

    engine prefill:  pos3 = model.mrope_positions(ids, valid, vision)  (left-padded rows, pads 0)
                     logits = model(ids, pos3, mask, cache, vision=vision); next_pos = pos3[0, :, -1] + 1
    engine decode:   model(step_ids, next_pos[:, None], mask, cache)   ([B, 1] text positions, as for text models)
    trainer:         model(ids, model.mrope_positions(ids, valid, vision), vision=vision)   (right-padded rows)

Image tokens get 3-D positions laid out by the image's patch grid; the text after an image continues from
the largest of them, so a row's positions run behind its token index (transformers' `get_rope_index`, which
`mrope_positions` calls on the valid tokens of each row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from config.model import ModelConfig
from engines.models.hf import HFCache, HFCausalLM
from engines.models.moe import Routing
from engines.models.vision import VisionInputs, VisionSpec

# The logit the trainer gives a vision-language model's image token: the engine never samples it (its logit is -inf
# there, engines/inference/embedded/generate.py), so the trainer scores the same distribution. Finite, so a masked
# target at an image position gives a finite logprob (times a zero loss mask: 0, not NaN); exp() of it is exactly 0
# next to any real logit, so every other token's logprob is the -inf distribution's, bit for bit.
NEVER_SAMPLED = -1e9


def is_vision(model: Any) -> bool:
    """Whether the policy model takes images (`forward(..., vision=...)`)."""
    return isinstance(model, HFVisionLM)


class HFVisionLM(HFCausalLM):
    vision_spec: VisionSpec

    def __init__(self, hf_model: Any, cfg: ModelConfig, spec: VisionSpec):
        super().__init__(hf_model, cfg, vocab_size=int(hf_model.config.get_text_config().vocab_size))
        self.vision_spec = spec
        if cfg.vision.freeze_vision_encoder:  # no gradients, so the optimizers (requires_grad only) never see it
            self.vision_encoder().requires_grad_(False)

    def _part(self, attr: str, key: str) -> nn.Module:
        module: Any = self.hf
        for name in attr.split("."):
            module = getattr(module, name, None)
            if module is None:
                children = ", ".join(n for n, _ in self.hf.named_children())
                raise ValueError(f"model.vlm.{key}={attr!r}: the model has no {name!r} there (top level: {children})")
        assert isinstance(module, nn.Module)
        return module

    def vision_encoder(self) -> nn.Module:
        return self._part(self.cfg.vision.vision_encoder_attr, "vision_encoder_attr")

    def language_model(self) -> nn.Module:
        return self._part(self.cfg.vision.language_model_attr, "language_model_attr")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: HFCache | None = None,
        routing: Routing | None = None,
        vision: VisionInputs | None = None,
    ) -> torch.Tensor:
        if routing is not None:
            super().forward(input_ids, routing=routing)  # raises the reason routing needs the custom code
        if positions is None:
            if cache is not None and cache.length:
                raise ValueError("a cached decode step of a vision-language model needs its positions")
            positions = self.mrope_positions(input_ids, torch.ones_like(input_ids, dtype=torch.bool), vision)
        elif positions.dim() == 2:
            positions = positions[None].expand(3, -1, -1)
        self._check_images(input_ids, vision)
        out = self.hf(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache.inner if cache is not None else None,
            use_cache=cache is not None,
            pixel_values=None if vision is None else vision.pixel_values.to(input_ids.device, self._dtype()),
            image_grid_thw=None if vision is None else vision.grid_thw.to(input_ids.device),
        )
        if cache is not None:
            cache.length += input_ids.shape[1]
        return out.logits

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` of the distribution the engine samples from: the image token never (NEVER_SAMPLED)."""
        return logits.index_fill(
            -1, torch.tensor([self.vision_spec.image_token_id], device=logits.device), NEVER_SAMPLED
        )

    def _dtype(self) -> torch.dtype:
        """The pixels' dtype: the weights' (read from the embedding, which the trainer's bf16 forward swaps too)."""
        return self.hf.get_input_embeddings().weight.dtype

    def _check_images(self, ids: torch.Tensor, vision: VisionInputs | None) -> None:
        """Image tokens and the images given must agree (transformers' own check raises a bare message later).
        Without images an image token is an embedding like any other (a decode step that sampled one), as in
        transformers; the trainer drops a sample whose completion holds one (engines/trainer/vision_batch.py)."""
        if vision is None:
            return
        tokens = int((ids == self.vision_spec.image_token_id).sum())
        want = sum(vision.tokens_per_image(self.vision_spec.merge_size))
        if tokens != want:
            raise ValueError(f"the batch has {tokens} image tokens but its images make {want}")

    def mrope_positions(
        self, ids: torch.Tensor, valid: torch.Tensor, vision: VisionInputs | None = None
    ) -> torch.Tensor:
        """[3, B, L] multimodal RoPE positions of the valid tokens of each row (pads 0; left or right padding):
        text tokens count on from the row's first valid token, image tokens take their patch grid's positions."""
        if vision is None or not bool((ids == self.vision_spec.image_token_id).any()):
            text = (valid.long().cumsum(-1) - 1).clamp(min=0).masked_fill(~valid, 0)
            return text[None].expand(3, -1, -1).clone()
        image = (ids == self.vision_spec.image_token_id) & valid
        positions, _ = self.hf.model.get_rope_index(
            ids, mm_token_type_ids=image.int(), image_grid_thw=vision.grid_thw, attention_mask=valid.long()
        )
        return positions


def from_directory(directory: str, cfg: ModelConfig, pretrained: bool) -> HFVisionLM:
    """transformers' image-text-to-text model of a VLM directory in float32 (as `hf.from_directory`)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if pretrained:
        model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    else:
        config = AutoConfig.from_pretrained(directory)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return HFVisionLM(model, cfg, VisionSpec.from_directory(directory))
