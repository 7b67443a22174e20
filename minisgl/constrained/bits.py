"""Token bitmask rows, the layout of grammar masks: 32 tokens an int32 word, bit t % 32 of word t // 32 set where
token t may be sampled (xgrammar's layout, which the sampler applies on the device)."""

from __future__ import annotations

import torch


def token_bits(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The [ceil(V/32)] int32 bitmask row (fill_masks' layout) allowing exactly `token_ids`."""
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    # each word's bits summed: distinct bits of one word add as they would be or-ed
    words.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))
    # as int32 two's complement: bit 31 set is a negative word, as the grammar engine writes it
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def clear_bits(row: torch.Tensor, token_ids: list[int] | tuple[int, ...]) -> None:
    """Clear the bits of `token_ids` in a bitmask row, one word at a time (for a few tokens: no tensor is built)."""
    for t in token_ids:
        # as an unsigned word and back: bit 31 is an int32 word's sign
        word = (int(row[t >> 5]) & 0xFFFFFFFF) & ~(1 << (t & 31))
        row[t >> 5] = word - (1 << 32) if word >= 1 << 31 else word
