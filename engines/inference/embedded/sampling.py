"""Seeded, batch-independent sampling: the noise for row b's t-th token is a pure function of
(seed_b, t, vocab index), so a sample does not depend on which other requests shared its batch.

That is what makes a killed-and-resumed run draw the same completions as an uninterrupted one:
requests reach the engine in a timing-dependent order and batch composition, but each request carries
its own seed. Sampling is Gumbel-max (argmax of log-probabilities plus Gumbel noise), which draws
exactly from the categorical distribution. The noise comes from splitmix64, a counter-based hash,
computed on int64 tensors (multiplication wraps modulo 2**64, right shifts are masked to be logical).
"""

from __future__ import annotations

import torch

from engines.seeds import C1, C2, GOLDEN, to_signed


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)  # logical shift on int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + to_signed(GOLDEN)
    x = (x ^ _shr(x, 30)) * to_signed(C1)
    x = (x ^ _shr(x, 27)) * to_signed(C2)
    return x ^ _shr(x, 31)


def uniform(seeds: torch.Tensor, position: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """[batch, vocab] float64 in (0, 1): counter-based noise for token `position` of each row.

    `position` is one int for the whole batch or a [batch] tensor: rows that joined a running batch at
    different steps each count their own tokens, and row b's noise depends on its own position only.
    """
    pos = torch.as_tensor(position, dtype=torch.int64).reshape(-1, 1)
    counters = torch.arange(vocab, dtype=torch.int64)[None, :] + pos * vocab
    bits = _shr(_mix(_mix(seeds[:, None]) ^ counters), 11)  # 53 random bits
    return (bits.double() + 0.5) * 2.0**-53


def sample(logp: torch.Tensor, seeds: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """Token ids drawn from `logp` ([batch, vocab] log-probabilities) with each row's own seed."""
    gumbel = -torch.log(-torch.log(uniform(seeds, position, logp.shape[-1])))
    return (logp.double() + gumbel).argmax(dim=-1)


def truncate(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens (0 = all) and its smallest set whose probability
    reaches `top_p` (1.0 = all), renormalized: the distribution the token is then drawn from.

    The most likely token always stays, so no row is left empty. Rows are independent of each other.
    """
    return truncate_kept(logp, top_k, top_p)[0]


def truncate_kept(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`truncate`'s distribution and, per row, the size of the support it kept: the number of tokens
    with non-zero probability after truncation ([rows] int64). The trainer scores a sampled token on
    exactly that support (the lake's `completion_kept`, docs/algorithm.md "Keep sampling mask")."""
    ordered, order = logp.sort(dim=-1, descending=True)
    rank = torch.arange(logp.shape[-1])[None, :]
    k = torch.where(top_k > 0, top_k, logp.shape[-1])[:, None]
    before = ordered.exp().cumsum(-1) - ordered.exp()  # probability mass ranked above each token
    drop = (rank >= k) | ((before >= top_p[:, None]) & (rank > 0))
    masked = ordered.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logp).scatter_(-1, order, masked)
    return torch.log_softmax(out, dim=-1), masked.isfinite().sum(-1)
