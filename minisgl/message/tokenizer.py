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
