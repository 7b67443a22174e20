"""Replies that wait together become one: a stream writes what has arrived, not one chunk per token.

While a client's previous chunk is being written (a slow reader, or an event loop busy with hundreds
of other streams) its next replies queue up. Writing them one by one would cost a JSON encoding and a
socket write per token and make every stream wait for the loop to come round once per token; joined,
they leave as one chunk carrying several tokens, as OpenAI's and SGLang's streams do under load. No
field is lost (`merge_replies`).
"""

from __future__ import annotations

from minisgl.message.frontend import UserReply, merge_replies


def coalesce(replies: list[tuple[int, UserReply]]) -> list[tuple[int, UserReply]]:
    """(choice index, reply) pairs with each choice's replies merged into one, in order of first arrival."""
    out: dict[int, UserReply] = {}
    for i, reply in replies:
        out[i] = merge_replies(out[i], reply) if i in out else reply
    return list(out.items())
