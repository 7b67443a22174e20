"""vLLM's bad_words: words a request's output never contains.

A word becomes the token sequences the model would write it as: its text alone, and after a space (a byte-level
BPE vocabulary has other tokens for " word" than for "word" at the start of a text). A sequence of one token bans
that token at every step; a longer one bans its last token at each step where the output so far ends with the
others. Only the output is looked at, as in vLLM: a prompt that ends with a word's first tokens bans nothing.
The bans are a bitmask row a step, applied in the batch as a grammar's mask is (`GrammarManager.fill_masks`).
"""

from __future__ import annotations

from typing import Any

import torch

from minisgl.constrained.bits import clear_bits, token_bits
from minisgl.params import RequestError


def word_sequences(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token sequences of `words`, each word as written alone and after a space, without repeats."""
    seen: set[tuple[int, ...]] = set()
    out: list[list[int]] = []
    for word in words:
        text = word.lstrip()
        for variant in (text, " " + text):
            ids = tuple(tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in seen and max(ids) < vocab_size:
                seen.add(ids)
                out.append(list(ids))
    return out


class BadWords:
    """One request's banned sequences: the bitmask row of what every step may sample (the one-token sequences'
    bits cleared), and by length, the tokens banned after each sequence of that many output tokens."""

    def __init__(self, sequences: list[list[int]], vocab_size: int) -> None:
        self.always = sorted({s[0] for s in sequences if len(s) == 1})
        # every token's bit set but those banned at every step (fill_masks' layout: 32 tokens an int32 word)
        self.keep = ~token_bits(self.always, vocab_size) if self.always else None
        self.after: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for s in sequences:
            if len(s) > 1:
                self.after.setdefault(len(s) - 1, {}).setdefault(tuple(s[:-1]), []).append(s[-1])

    def apply(self, row: torch.Tensor, ids: list[int], prompt_len: int) -> None:
        """Clear in a bitmask row the tokens the next step may not sample, given the request's tokens `ids`
        (its prompt's first)."""
        if self.keep is not None:
            row &= self.keep
        generated = len(ids) - prompt_len
        for n, table in self.after.items():
            if generated >= n:
                clear_bits(row, table.get(tuple(ids[len(ids) - n :]), ()))

    def check_allowed(self, allowed: list[int] | None) -> None:
        """Refuse a request whose allowed_token_ids are all banned at every step: it could sample nothing."""
        if allowed is not None and set(allowed) <= set(self.always):
            raise RequestError(
                "bad_words bans every token of allowed_token_ids, which would leave nothing to sample; "
                "allow a token none of the words is",
                "bad_words",
                "invalid_bad_words",
            )
