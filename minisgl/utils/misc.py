"""Small arithmetic helpers."""

from __future__ import annotations


def div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def align_up(a: int, b: int) -> int:
    return div_ceil(a, b) * b


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): triton.next_power_of_2 without its constexpr
    wrapper, which costs about 1.5 us a call in a kernel wrapper's Python."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
