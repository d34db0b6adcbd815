"""The policy model's shape."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Strict


class ModelConfig(Strict):
    """Decoder-only transformer shape (Llama/Qwen3 naming). `vocab_size` comes from the tokenizer."""

    hidden_size: int = Field(192, gt=0)
    num_layers: int = Field(3, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_seq_len: int = Field(64, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    qk_norm: bool = False  # Qwen3-style per-head RMSNorm on q and k
    tie_word_embeddings: bool = True
    # Qwen3-MoE (config.json names): with num_experts > 0 the sparse layers' MLPs are expert blocks
    num_experts: int = Field(0, ge=0, description="experts per MoE layer; 0 = dense model")
    num_experts_per_tok: int = Field(2, gt=0, description="top-k experts each token is routed to")
    moe_intermediate_size: int | None = Field(
        None, gt=0, description="hidden width of one expert; None: intermediate_size"
    )
    norm_topk_prob: bool = Field(True, description="renormalise the top-k gate weights to sum to 1")
    decoder_sparse_step: int = Field(1, gt=0, description="every N-th layer is sparse")
    mlp_only_layers: list[int] = Field(default_factory=list, description="layers that stay dense")

    @model_validator(mode="after")
    def _experts(self) -> ModelConfig:
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.num_experts={self.num_experts}"
            )
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        return self
