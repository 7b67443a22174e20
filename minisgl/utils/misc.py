"""Small arithmetic helpers."""

from __future__ import annotations


def div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def align_up(a: int, b: int) -> int:
    return div_ceil(a, b) * b
