"""The embedded engine's per-token stop-string check: it finds what a full decode finds, at a cost per token that
does not grow with the row or with its stop strings."""

from __future__ import annotations

from engines.inference.embedded.serving import Prepared, Serving, StopMatcher, _Texts, cut, stop_check
from engines.models.tokenizer import CharTokenizer
from engines.protocol import MAX_STOP_CHARS, CompletionRequest


class Counting(CharTokenizer):
    """The real tokenizer, counting the ids it decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special)


def _first_stop(tok, stops: list[str], text: str) -> int | None:
    """After how many tokens the check ends a row whose tokens spell `text` (None: never)."""
    ids = tok.encode(text, bos=False)
    check = stop_check(tok, stops)()
    return next((k for k in range(1, len(ids) + 1) if check(ids[:k])), None)


def test_it_stops_where_a_full_decode_finds_the_stop_string():
    tok = CharTokenizer()
    for stops, text in ((["cd"], "abcdef"), (["xy", "bcd"], "abcdef"), (["zz"], "abcdef"), (["a"], "a")):
        found = _first_stop(tok, stops, text)
        expected = next((k for k in range(1, len(text) + 1) if cut(text[:k], stops)[1]), None)
        assert found == expected, (stops, text)


def test_a_token_costs_the_same_however_long_the_row_and_its_stop_strings():
    tok = Counting()
    stops = [c * MAX_STOP_CHARS for c in "wxyz"]  # the longest stop strings a request may send
    check = StopMatcher(tok, stops)
    ids = tok.encode("ab" * 2000, bos=False)
    per_token = []
    for k in range(1, len(ids) + 1):
        before = tok.decoded
        assert not check(ids[:k])
        per_token.append(tok.decoded - before)
    assert max(per_token) <= 3, max(per_token)  # the new token and the one before it, twice at most


def test_a_streamed_token_costs_the_same_however_long_the_choice():
    """Streaming decodes each choice's new tokens only (the whole text once, at its end), and sends the text the
    unstreamed answer has: the stop string cut, nothing held back at the end."""
    tok = Counting()
    serving = Serving(None, tok, "m")
    body = CompletionRequest(prompt=[1], n=1, stream=True, stop=["zz"])
    texts = _Texts(serving, Prepared(body, [1], None, chat=False, id="x", created=0))  # type: ignore[arg-type]
    ids = tok.encode("ab" * 1000 + "zzq", bos=False)
    sent, per_token = "", []
    for k, t in enumerate(ids):
        before = tok.decoded
        (chunk,) = texts.chunks([(0, t, 0.0, k == len(ids) - 1, 0, "length", None)]) or [None]
        per_token.append(tok.decoded - before)
        if chunk is not None:
            sent += chunk["choices"][0]["text"]
    assert sent == "ab" * 1000 and max(per_token[:-3]) <= 3, max(per_token[:-3])
