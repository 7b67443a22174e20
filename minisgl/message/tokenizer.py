"""Messages out of the scheduler, to the detokenizer (or to LLM in offline mode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DetokenizeMsg:
    uid: int
    next_token: int  # -1 when the request ends without a new token (error, abort)
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    error: str | None = None  # what the user should change, for finish_reason "error"
    error_code: str | None = None  # RequestError.code, for the API's error body
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (sent with the first token)
    prompt_tokens: int = 0
    logprob: float | None = None  # the new token's log-probability, when the request asks for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, log-probability), most likely first
    # with the first token, when the request asks: [token id, log-probability, rank, top] of each prompt
    # token, top as [[token id, log-probability], ...]; the first token's log-probability and rank are None
    prompt_logprobs: list[list[Any]] | None = None
    matched_eos: bool = False  # finish_reason "stop" came from an EOS token, not from a stop_token_ids id


@dataclass
class FlushCacheReply:
    """The scheduler's answer to a FlushCacheMsg: the pages the prefix cache gave back, or why it was not
    emptied (requests were running or waiting)."""

    uid: int
    freed_pages: int = 0
    error: str | None = None


@dataclass
class TokenStepMsg:
    """The plain part of a scheduler step: request `uids[i]` produced `tokens[i]` and runs on.

    Most of a decode step is such tokens; as two lists of integers they cost the scheduler no
    per-request encoding (a message per request costs microseconds each, hundreds a step). A token
    that carries more (a finish, log-probabilities, the first token's prompt counts) travels as a
    DetokenizeMsg beside it.
    """

    uids: list[int]
    tokens: list[int]


def pack_step(msgs: list[Any]) -> list[Any]:
    """The step's messages for the wire: the plain tokens in one TokenStepMsg, the rest as they are."""
    uids, tokens, rest = [], [], []
    for m in msgs:
        if type(m) is DetokenizeMsg and _plain(m):
            uids.append(m.uid)
            tokens.append(m.next_token)
        else:
            rest.append(m)
    return [TokenStepMsg(uids, tokens), *rest] if uids else rest


def unpack_step(msgs: list[Any]) -> list[Any]:
    """`pack_step` undone: a DetokenizeMsg a token again (the plain ones first)."""
    out = []
    for m in msgs:
        if isinstance(m, TokenStepMsg):
            out += [DetokenizeMsg(uid, token, False) for uid, token in zip(m.uids, m.tokens)]
        else:
            out.append(m)
    return out


def _plain(m: DetokenizeMsg) -> bool:
    """A token and nothing else: every other field at its default (a field added later is kept apart)."""
    return m.next_token >= 0 and m == DetokenizeMsg(m.uid, m.next_token, False)
