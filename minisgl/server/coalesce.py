"""Replies that wait together become one: a stream writes what has arrived, not one chunk per token.

While a client's previous chunk is being written (a slow reader, or an event loop busy with hundreds
of other streams) its next replies queue up. Writing them one by one would cost a JSON encoding and a
socket write per token and make every stream wait for the loop to come round once per token; joined,
they leave as one chunk carrying several tokens, as OpenAI's and SGLang's streams do under load. No
field is lost: text, log-probabilities and token ids add up, counts and the finish are the latest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from minisgl.message.frontend import UserReply

T = TypeVar("T")


def merge(first: UserReply, later: UserReply) -> UserReply:
    """One reply saying what `first` and then `later` (of the same request) said."""
    return replace(
        later,
        text=first.text + later.text,
        logprobs=_joined(first.logprobs, later.logprobs),
        token_ids=_joined(first.token_ids, later.token_ids),
        # the prompt's fields come with a request's first reply only
        prompt_token_ids=first.prompt_token_ids
        if first.prompt_token_ids is not None
        else later.prompt_token_ids,
        prompt_text=first.prompt_text if first.prompt_text is not None else later.prompt_text,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
    )


def coalesce(replies: list[tuple[int, UserReply]]) -> list[tuple[int, UserReply]]:
    """(choice index, reply) pairs with each choice's replies merged into one, in order of first arrival."""
    out: dict[int, UserReply] = {}
    for i, reply in replies:
        out[i] = merge(out[i], reply) if i in out else reply
    return list(out.items())


def _joined(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    if a is None:
        return b
    return a if b is None else a + b
