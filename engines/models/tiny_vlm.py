"""A tiny Qwen3-VL written as a complete, offline Hugging Face directory: the VLM the tests and the toy visual
profile start from (nothing is downloaded).

    python -m engines.models.tiny_vlm OUT_DIR [--seed N] [--moe]

writes config.json (a `Qwen3VLConfig`: 2 text layers of width 64, a 2-block vision encoder of width 32, patches
of 16 merged 2 x 2, so a 64 x 64 image is 4 tokens), generation_config.json, model.safetensors (random weights
from the seed, float32, written by transformers' own `save_pretrained`), the tokenizer (the built-in
CharTokenizer's characters plus Qwen's vision tokens, `tokenizer.json` + `tokenizer_config.json`) whose chat
template renders a user message's `{"type": "image"}` parts as `<|vision_start|><|image_pad|><|vision_end|>`
and its text parts as text, in the character tokenizer's style (`<bos>content=`), and preprocessor_config.json
(`VisionSpec.preprocessor_config()`). `transformers.AutoModelForImageTextToText` and `AutoTokenizer` load it;
`VisionSpec.from_directory` reads its image token layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engines.models.tokenizer import CHARS, SPECIAL, write_char_tokenizer
from engines.models.vision import VisionSpec

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = SPECIAL + CHARS + VISION_TOKENS
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}

# Content may be a string (the character tokenizer's template) or OpenAI-style parts: images, then text.
# An assistant turn ends with <eos> (the token it samples last), so multi-turn continuations render as they do
# for the character tokenizer: the following messages' text, then `=`.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def spec() -> VisionSpec:
    """The tiny VLM's image token layout: 64 x 64 images (the bounds allow 32 x 32 to 128 x 128)."""
    return VisionSpec(
        image_token_id=TOKEN_ID["<|image_pad|>"],
        vision_start_id=TOKEN_ID["<|vision_start|>"],
        vision_end_id=TOKEN_ID["<|vision_end|>"],
        min_pixels=32 * 32,
        max_pixels=128 * 128,
    )


def config(max_positions: int = 512, moe: bool = False) -> Any:
    """The tiny Qwen3-VL's config; `moe`: Qwen3-VL-MoE (4 experts of width 32, 2 per token, every layer sparse)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    s = spec()
    text = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        tie_word_embeddings=True,
        bos_token_id=TOKEN_ID["<bos>"],
        eos_token_id=TOKEN_ID["<eos>"],
        pad_token_id=TOKEN_ID["<pad>"],
    )
    if moe:
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=s.patch_size,
        spatial_merge_size=s.merge_size,
        temporal_patch_size=s.temporal_patch_size,
        out_hidden_size=64,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=s.image_token_id,
        video_token_id=TOKEN_ID["<|video_pad|>"],
        vision_start_token_id=s.vision_start_id,
        vision_end_token_id=s.vision_end_id,
        tie_word_embeddings=True,
    )


def save_tokenizer(directory: Path) -> None:
    """tokenizer.json: one token per character (the CharTokenizer's ids), the specials and vision tokens whole;
    environments write short tag prompts for a character vocabulary (`rollflow_prompt_style`)."""
    write_char_tokenizer(directory, dict(TOKEN_ID), SPECIAL + VISION_TOKENS, CHAT_TEMPLATE, rollflow_prompt_style="tag")


def write(directory: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """Build the tiny Qwen3-VL (`moe`: Qwen3-VL-MoE) with weights drawn from `seed` and save it as a Hugging
    Face directory."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config(moe=moe), dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=TOKEN_ID["<bos>"], eos_token_id=TOKEN_ID["<eos>"], pad_token_id=TOKEN_ID["<pad>"]
    )
    model.save_pretrained(str(out))
    save_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps(spec().preprocessor_config(), indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="Qwen3-VL-MoE instead of the dense Qwen3-VL")
    args = parser.parse_args(argv)
    print(write(args.out_dir, args.seed, args.moe))


if __name__ == "__main__":
    main()
