"""Tokenizers behind one interface: the built-in character tokenizer and Hugging Face tokenizers.

`Tokenizer` is what the engine, trainer and orchestrator use: ids of special tokens, `encode`/`decode`,
`render_prompt` (a user message through the chat template, with the generation prompt) and
`save_pretrained`; `render_conversation` renders a whole chat with a mask over its assistant turns (what
supervised fine-tuning trains). `CharTokenizer` is built in-process: encoding is a dict lookup per character, and
`save_pretrained` writes `tokenizer.json` + `tokenizer_config.json` that `transformers.AutoTokenizer` loads
to the same ids. `HFTokenizer` wraps the tokenizer of a model directory (engines/models/modeldir.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 :=.,!?-_")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


class Tokenizer(Protocol):
    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def prompt_style(self) -> str:
        """The environment prompt style it suits: "tag" or "instruct" (engines/environments/base.py)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def render_prompt(self, content: str) -> list[int]: ...

    def render_messages(self, messages: list[dict]) -> list[int]: ...

    def render_continuation(self, messages: list[dict]) -> list[int]:
        """Ids of environment/tool `messages` that follow a finished assistant turn (after its sampled
        end-of-sequence), through the generation prompt of the next assistant turn: multi-turn episodes
        append them to the sampled ids instead of re-rendering (and re-tokenizing) the conversation."""
        ...

    def save_pretrained(self, directory: str | Path) -> None: ...


ROLES = ("system", "user", "assistant", "tool")


def render_conversation(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, mask over ids) of a conversation as the model meets it when it generates: the messages before
    an assistant turn through the chat template, ending with the generation prompt (the first time with
    `render_messages`, later with `render_continuation` after the previous turn's end-of-sequence), and each
    assistant turn as the tokens it samples, its content and the end-of-sequence, mask 1. Messages after
    the last assistant turn train nothing and are left out; the caller checks that there is an assistant turn.
    """
    ids: list[int] = []
    mask: list[int] = []
    pending: list[dict] = []
    for m in messages:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        context = tok.render_continuation(pending) if ids else tok.render_messages(pending)
        turn = tok.encode(m["content"], bos=False) + [tok.eos_id]
        ids += context + turn
        mask += [0] * len(context) + [1] * len(turn)
        pending = []
    return ids, mask


def _compiled(template: str) -> Any:
    import jinja2

    return jinja2.Environment().from_string(template)


class CharTokenizer:
    prompt_style = "tag"

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

    def render_prompt(self, content: str) -> list[int]:
        """`<bos>` + content + `=` through CHAT_TEMPLATE: the ids `encode(content + "=")` gives."""
        return self.render_messages([{"role": "user", "content": content}])

    def render_messages(self, messages: list[dict]) -> list[int]:
        if any(not isinstance(m["content"], str) for m in messages):  # the template would print a list's repr
            raise ValueError(
                "the built-in character tokenizer renders text messages only; a message with content parts "
                "(images) needs a vision-language model (model.path, docs/models.md)"
            )
        if not hasattr(self, "_template"):
            self._template = _compiled(CHAT_TEMPLATE)
        text = self._template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
        return [self.bos_id, *self.encode(text.removeprefix("<bos>"), bos=False)]

    def render_continuation(self, messages: list[dict]) -> list[int]:
        """CHAT_TEMPLATE concatenates contents and opens a turn with `=`: the messages' text, then `=`."""
        return self.encode("".join(m["content"] for m in messages) + "=", bos=False)

    def save_pretrained(self, directory: str | Path) -> None:
        write_char_tokenizer(Path(directory), self.vocab, SPECIAL, CHAT_TEMPLATE)


def write_char_tokenizer(
    directory: Path, vocab: dict[str, int], specials: list[str], chat_template: str, **extra: Any
) -> None:
    """tokenizer.json (one token per character, `specials` whole) + tokenizer_config.json that
    `transformers.AutoTokenizer` loads to the ids of `vocab`; `extra` goes into tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": chat_template,
        "model_max_length": 4096,
        **extra,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


class HFTokenizer:
    """A Hugging Face tokenizer directory; prompts go through its chat template, whose user messages may carry
    OpenAI-style content parts (`[{"type": "image"}, ..., {"type": "text", "text": ...}]`): a vision-language
    model's template writes its image placeholder for each image part (engines/models/vision.py expands it).
    The prompt style is "instruct" unless tokenizer_config.json says `"rollflow_prompt_style": "tag"` (the tiny
    character-vocabulary VLM, engines/models/tiny_vlm.py)."""

    prompt_style = "instruct"

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        self.hf = AutoTokenizer.from_pretrained(str(directory))
        if not self.hf.chat_template:
            raise ValueError(
                f"{self.directory / 'tokenizer_config.json'}: no chat_template (nor chat_template.jinja): the "
                "environments render prompts through it; use an instruct/chat checkpoint or add a chat template"
            )
        if self.hf.eos_token_id is None:
            raise ValueError(f"{self.directory / 'tokenizer_config.json'}: no eos_token; generation needs one")
        self.eos_id: int = self.hf.eos_token_id
        self.bos_id: int | None = self.hf.bos_token_id
        self.pad_id: int = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        if self.hf.init_kwargs.get("rollflow_prompt_style") in ("tag", "instruct"):
            self.prompt_style = self.hf.init_kwargs["rollflow_prompt_style"]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special))

    def render_prompt(self, content: str) -> list[int]:
        """One user message through the chat template, ending with the assistant turn's opening."""
        return self.render_messages([{"role": "user", "content": content}])

    def render_messages(self, messages: list[dict]) -> list[int]:
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.hf.encode(text, add_special_tokens=False)

    def render_continuation(self, messages: list[dict]) -> list[int]:
        """The template's text after a finished assistant turn's end-of-sequence token, for these messages.

        Rendered after a placeholder exchange and cut at that exchange's last eos string: what the template
        puts between the eos and the next turn (Qwen's newline) is kept, the eos itself was sampled.
        """
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = str(self.hf.apply_chat_template(base, tokenize=False))
        after = str(self.hf.apply_chat_template(base + messages, add_generation_prompt=True, tokenize=False))
        eos = str(self.hf.eos_token)
        cut = before.rfind(eos)
        if cut < 0 or not after.startswith(before[: cut + len(eos)]):
            raise ValueError(f"{self.directory}: the chat template does not end an assistant turn with {eos!r}")
        return self.hf.encode(after[cut + len(eos) :], add_special_tokens=False)

    def save_pretrained(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))
