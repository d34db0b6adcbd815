"""Seeds derived from integers (run seed, step, group, sample): stable across processes, Python runs and
machines, and free of torch, so the orchestrator (which does not import torch) and the embedded engine
derive the same seeds. splitmix64 is the counter-based hash the engine's sampling noise is built on too.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
# splitmix64's constants, shared with the engine's tensor version of the hash
GOLDEN = 0x9E3779B97F4A7C15
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """Reference splitmix64 finalizer on Python ints (unsigned 64-bit result)."""
    x = (x + GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * C1) & _MASK64
    x = ((x ^ (x >> 27)) * C2) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, step, group, ...): stable across processes and Python runs."""
    x = 0
    for p in parts:
        x = splitmix64(x ^ (p & _MASK64))
    return x >> 1


def row_seeds(seed: int, n: int) -> list[int]:
    """Seeds for the n samples of one request (a group shares its prompt, not its noise)."""
    return [derive_seed(seed, k) for k in range(n)]
