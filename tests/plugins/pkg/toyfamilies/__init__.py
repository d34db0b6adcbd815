"""A model family from outside rollflow: `mini_llama`, a Llama-architecture model under its own config.json
`model_type`, run by rollflow's own decoder. Registered as the `rollflow.model_families` entry point
`mini_llama = toyfamilies:MINI_LLAMA` (tests/family_fixture.py writes that dist-info).

Its config.json names the MLP width `ffn_dim` (where Llama says `intermediate_size`), and the family refuses
what the decoder does not run (`impl = "custom"` then says why; `auto` hands it to transformers)."""

from __future__ import annotations

from engines.models.families import Family


def _check(hf: dict) -> str | None:
    if hf.get("ffn_dim") is None:
        return "no ffn_dim (mini_llama's MLP width)"
    return "parallel_residual=true (the decoder runs sequential blocks)" if hf.get("parallel_residual") else None


MINI_LLAMA = Family(
    "mini_llama",
    "LlamaForCausalLM",
    qk_norm=False,
    check=_check,
    extra_fields={"ffn_dim": "intermediate_size"},
    constants={"mlp_bias": False},
)

NOT_A_FAMILY = "mini_llama"  # registered by mistake: refused by name
