"""Character-level tokenizer built in-process, saved with the run in Hugging Face format.

Encoding is a dict lookup per character (fast, no dependencies). `save_pretrained` writes
`tokenizer.json` + `tokenizer_config.json` that `transformers.AutoTokenizer` loads to the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 :=.,!?-_")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


class CharTokenizer:
    def __init__(self) -> None:
        self.vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
        self.inverse = {i: tok for tok, i in self.vocab.items()}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (self.vocab[t] for t in SPECIAL)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = [self.vocab.get(ch, self.unk_id) for ch in text]
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        special = set(range(len(SPECIAL))) if skip_special else set()
        return "".join(self.inverse.get(i, "") for i in ids if i not in special)

    def save_pretrained(self, directory: str | Path) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer(models.WordLevel(self.vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(SPECIAL)
        tok.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 4096,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
