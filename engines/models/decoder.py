"""One decoder-only transformer for trainer and inference, with Llama/Qwen3 parameter naming.

Keys match Hugging Face's `LlamaForCausalLM` / `Qwen3ForCausalLM` (`model.layers.0.self_attn.q_proj.weight`,
...), so safetensors of that family load with `load_state_dict`. Generation uses a preallocated KV cache
and left padding; a position's RoPE index counts only real tokens, so cached decoding and the trainer's
full forward see identical positions and produce the same logprobs.

With `model.num_experts > 0` every layer's MLP is a Qwen3-MoE sparse block (engines/models/moe.py); a `Routing`
passed to `forward` records the experts each token was routed to and can replay given ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from config.model import ModelConfig
from engines.models.moe import Routing, SparseMoeBlock, build_sparse_mlp, is_sparse
from storage.lora import is_adapter_key


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, head_dim] in HF's rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclass
class KVCache:
    """Preallocated keys/values per layer: [B, kv_heads, capacity, head_dim]; `length` slots are filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype) -> KVCache:
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_size)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)],
            values=[torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)],
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) batch rows `rows` of every layer's keys and values, in that order."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]

    def realign(self, front: int, capacity: int) -> None:
        """Shift the filled slots by `front` (> 0: that many empty slots before them, which the caller masks
        out; < 0: drop the first -front) into tensors of `capacity` slots: how rows that joined a running
        batch at another length line up with it (engines/inference/embedded/generate.py)."""
        length = self.length + front
        keep = slice(max(0, -front), self.length)

        def moved(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((*t.shape[:2], capacity, t.shape[3]))
            out[:, :, max(0, front) : length] = t[:, :, keep]
            return out

        self.keys, self.values = [moved(k) for k in self.keys], [moved(v) for v in self.values]
        self.length = length

    def extend(self, other: KVCache) -> None:
        """Append `other`'s rows (same length and capacity) after these."""
        assert other.length == self.length, (other.length, self.length)
        self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, other.keys, strict=True)]
        self.values = [torch.cat([a, b]) for a, b in zip(self.values, other.values, strict=True)]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_size
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim)  # -1: tensor parallel ranks hold some heads
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = cache.length
            cache.keys[layer][:, :, start : start + t] = k
            cache.values[layer][:, :, start : start + t] = v
            k, v = cache.keys[layer][:, :, : start + t], cache.values[layer][:, :, : start + t]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward block of decoder layer `layer`: dense SwiGLU, or a sparse MoE block."""
    if not is_sparse(cfg, layer):
        return MLP(cfg)
    index = sum(is_sparse(cfg, i) for i in range(layer))  # position among the MoE layers (routing payload axis)
    return build_sparse_mlp(cfg, index)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_mlp(cfg, layer)

    def forward(self, x, cos, sin, mask, cache, layer, routing: Routing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routing) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Publishable:
    """Publication I/O shared by rollflow's model and the transformers wrapper (engines/models/hf.py):
    state dicts with the family's Hugging Face names, the tied `lm_head.weight` alias left out. LoRA adapter
    keys (engines/models/lora.py) are never part of the base publication; a state dict may carry them on load."""

    cfg: ModelConfig

    def weights_module(self) -> nn.Module:
        """The module whose state dict carries the Hugging Face parameter names."""
        assert isinstance(self, nn.Module)
        return self

    def publishable_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict without the tied `lm_head.weight` alias (HF convention; safetensors rejects aliases)."""
        sd = self.weights_module().state_dict()
        if self.cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return {k: v for k, v in sd.items() if not is_adapter_key(k)}

    def check_published(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless `state_dict` has exactly this model's published keys and shapes."""
        expected = {k: tuple(v.shape) for k, v in self.publishable_state_dict().items()}
        if any(is_adapter_key(k) for k in state_dict):  # base + adapter: the adapters must fit too
            full = self.weights_module().state_dict()
            expected |= {k: tuple(v.shape) for k, v in full.items() if is_adapter_key(k)}
        got = {
            k: tuple(v.shape)
            for k, v in state_dict.items()
            if not (k == "lm_head.weight" and self.cfg.tie_word_embeddings)
        }
        missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
        if missing or unexpected or wrong:
            shapes = [f"{k}: {got[k]} vs model {expected[k]}" for k in wrong[:5]]
            raise ValueError(
                f"weights do not fit the model: missing={missing[:5]} unexpected={unexpected[:5]} shapes={shapes}"
            )

    def load_published(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load published weights; checks everything first so a bad file leaves the model untouched."""
        self.check_published(state_dict)
        self.weights_module().load_state_dict(state_dict, strict=False)


class CausalLM(Publishable, nn.Module):
    """`forward(ids, positions, mask, cache, routing) -> logits`; mask None means plain causal attention."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.model = Backbone(cfg, vocab_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_size, self.cfg.rope_theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # a no-op in fp32; keeps a bf16 model in bf16
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i, routing)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.lm_head(self.model.norm(x))

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype) -> KVCache:
        return KVCache.empty(self.cfg, batch, capacity, dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature); logits [B, T, V], targets [B, T]."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.view(-1, *([1] * (logits.dim() - 1)))
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
