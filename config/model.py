"""The policy model: its source (built-in or a Hugging Face directory), implementation and shape."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.base import Strict
from config.registry import MODEL_FAMILIES, MODEL_FAMILY_GROUP, one_of

# The seed's cross-family default: attention and MLP projections, MoE experts, and the latent projections of
# multi-head latent attention; names a model does not have are ignored.
DEFAULT_LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
]


class LoRAConfig(Strict):
    """Low-rank adapters (docs/models.md): only the adapters train; publications carry the adapter and a
    checksummed reference to the base weights (policy version 0) it applies to."""

    rank: int = Field(8, gt=0, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Linear layers to adapt, by their own name or the name of a module containing them "
        "(e.g. experts); names the model lacks are ignored",
    )
    save_merged: bool = Field(
        False, description="also write the merged weights (model.safetensors) into every adapter publication"
    )


class VLMConfig(Strict):
    """[model.vlm]: a vision-language model (docs/models.md "Vision-language models"). A directory whose
    config.json has a `vision_config` is one whether or not this table is given (the defaults apply); the
    attributes name where transformers' model keeps its parts, as in the seed's VLM registry.

    Precision: the seed makes bfloat16 mandatory for VLMs because vLLM serves them in bfloat16 and a trainer in
    another precision skews the importance ratio. rollflow's trainer keeps float32 weights and optimizer state
    whatever its matmuls' precision (`trainer.compute_dtype`); the sampler's is `inference.dtype`, and the gap
    between the two is what `mismatch_kl` (per number of images: `mismatch_kl/images=K`) measures and the loss
    corrects."""

    vision_encoder_attr: str = Field(
        "model.visual", min_length=1, description="dotted attribute of the vision encoder in the transformers model"
    )
    language_model_attr: str = Field(
        "model.language_model",
        min_length=1,
        description="dotted attribute of the language model (its `.layers` are the decoder layers)",
    )
    freeze_vision_encoder: bool = Field(
        True,
        description="keep the vision encoder's weights fixed: no gradients, not in the optimizer "
        "(false trains it too; refused with [model.lora], which trains adapters only)",
    )


class ModelConfig(Strict):
    """The policy model. Without `path`: rollflow's built-in decoder (Llama/Qwen3 naming) of the shape below,
    with the character tokenizer and a supervised warm-up. With `path`: a Hugging Face model directory whose
    config.json sets the architecture fields below (their values here are then ignored) and whose tokenizer
    and chat template the run uses (docs/models.md). `vocab_size` None means the tokenizer's."""

    path: str | None = Field(
        None,
        description="Hugging Face model directory, a name in the local HF cache (org/name), or a name "
        "fetched by `rollflow models fetch`; None builds the built-in model from the fields below",
    )
    impl: Literal["auto", "custom", "hf"] = Field(
        "auto",
        description="custom: rollflow's model code; hf: transformers' AutoModelForCausalLM; "
        "auto: custom when config.json's model_type is a registered family it supports, else hf",
    )
    family: str | None = Field(
        None,
        description="registered family (config/registry.py); None: qwen3_moe with experts, qwen3 with "
        "qk_norm, else llama",
    )
    hidden_size: int = Field(192, gt=0)
    num_layers: int = Field(3, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int | None = Field(None, gt=0, description="None: hidden_size // num_heads")
    intermediate_size: int = Field(512, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    max_seq_len: int = Field(64, gt=0, description="longest prompt + completion the run serves and trains")
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    qk_norm: bool = False  # Qwen3-style per-head RMSNorm on q and k
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = True
    # Mixture of experts (family qwen3_moe); 0 experts = dense.
    num_experts: int = Field(0, ge=0, description="experts per MoE layer; 0 = dense model")
    num_experts_per_tok: int = Field(2, gt=0, description="top-k experts each token is routed to")
    moe_intermediate_size: int | None = Field(None, gt=0, description="one expert's width; None: intermediate_size")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k gate weights to sum to 1")
    decoder_sparse_step: int = Field(1, gt=0, description="every N-th layer is sparse")
    mlp_only_layers: list[int] = Field(default_factory=list, description="layers that stay dense")
    lora: LoRAConfig | None = Field(None, description="[model.lora]: train low-rank adapters only (None: all weights)")
    vlm: VLMConfig | None = Field(
        None,
        description="[model.vlm]: vision-language model settings; None: the defaults when model.path is a VLM "
        "(its config.json has a vision_config)",
    )

    @field_validator("family")
    @classmethod
    def _registered(cls, family: str | None) -> str | None:
        return family if family is None else one_of("model family", family, MODEL_FAMILIES, MODEL_FAMILY_GROUP)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads} "
                "(or set model.head_dim)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.num_experts={self.num_experts}"
            )
        return self

    @model_validator(mode="after")
    def _lora_keeps_the_encoder_frozen(self) -> ModelConfig:
        """The seed's rule: LoRA freezes every non-adapter weight, so an unfrozen encoder would silently not train."""
        if self.lora is not None and self.vlm is not None and not self.vlm.freeze_vision_encoder:
            raise ValueError(
                "model.vlm.freeze_vision_encoder = false with [model.lora]: LoRA trains its adapters only and keeps "
                "every other weight fixed, so the vision encoder would not train; drop [model.lora] to fine-tune "
                "the encoder, or keep model.vlm.freeze_vision_encoder = true"
            )
        return self

    @property
    def vision(self) -> VLMConfig:
        """[model.vlm] as given, or its defaults (for a VLM directory without the table)."""
        return self.vlm or VLMConfig()

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def family_name(self) -> str:
        return self.family or ("qwen3_moe" if self.num_experts else "qwen3" if self.qk_norm else "llama")
