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


# Rows of noise made at once by `sample`: a chunk's int64 and float64 buffers (2 x rows x vocab x 8 bytes) stay in a
# core's L2 cache across the ~25 elementwise passes, where whole-batch tensors would stream through memory each pass.
CHUNK_BYTES = 1 << 20


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """`_mix` in place on x (tmp: scratch of x's shape): the same int64 operations, no allocation."""
    x.add_(to_signed(GOLDEN))
    for shift, mult in ((30, to_signed(C1)), (27, to_signed(C2)), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)
    return x


def _gumbel_argmax(logp: torch.Tensor, mixed_seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`sample` on a chunk of rows, in place on two scratch buffers: bit for bit `uniform`'s noise and the
    same float64 operations in the same order, so the drawn tokens are identical."""
    rows, vocab = logp.shape
    x = torch.arange(vocab, dtype=torch.int64).repeat(rows, 1).add_(pos * vocab).bitwise_xor_(mixed_seeds)
    tmp = torch.empty_like(x)
    _mix_(x, tmp)
    torch.bitwise_right_shift(x, 11, out=tmp)
    tmp.bitwise_and_((1 << 53) - 1)
    g = tmp.to(torch.float64).add_(0.5).mul_(2.0**-53)  # uniform in (0, 1)
    g.log_().neg_().log_().neg_()  # Gumbel noise: -log(-log(u))
    return g.add_(logp).argmax(dim=-1)  # logp (float32) + noise in float64, as logp.double() + gumbel


def sample(logp: torch.Tensor, seeds: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """Token ids drawn from `logp` ([batch, vocab] log-probabilities) with each row's own seed: the argmax of
    logp + Gumbel noise made from `uniform`, a chunk of rows at a time (CHUNK_BYTES)."""
    batch, vocab = logp.shape
    pos = torch.as_tensor(position, dtype=torch.int64).reshape(-1, 1).expand(batch, 1)
    mixed = _mix(seeds[:, None])
    step = max(1, CHUNK_BYTES // (16 * vocab))
    parts = [_gumbel_argmax(logp[i : i + step], mixed[i : i + step], pos[i : i + step]) for i in range(0, batch, step)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def sample_reference(logp: torch.Tensor, seeds: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """`sample` written plainly on whole-batch tensors: the definition the chunked version must equal."""
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
