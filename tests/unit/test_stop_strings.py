"""The embedded engine's per-token stop-string check: it finds what a full decode finds, at a cost per token that
does not grow with the row or with its stop strings."""

from __future__ import annotations

from engines.inference.embedded.serving import StopMatcher, cut, stop_check
from engines.models.tokenizer import CharTokenizer
from engines.protocol import MAX_STOP_CHARS


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
