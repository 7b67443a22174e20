"""The one request check: what the tokenizer worker, the scheduler and LLM each ask before a request runs."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.constrained.grammar import check_grammar
from minisgl.core import RequestError, SamplingParams
from minisgl.utils.misc import div_ceil


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can take: the context length, the vocabulary and the whole KV pool."""

    max_seq_len: int
    vocab_size: int
    num_pages: int
    page_size: int


def check_params(params: SamplingParams) -> None:
    """The parameters alone: their ranges, and that a grammar compiles; raises RequestError."""
    params.validate()
    check_grammar(params)


def check_request(
    input_ids: list[int], params: SamplingParams, limits: RequestLimits, params_checked: bool = False
) -> int:
    """Raise RequestError saying what to change; return the max_tokens the request runs with.

    max_tokens is cut to what the context length leaves after the prompt; the caller keeps that
    number on its request, so `params` stays as the user sent it. `params_checked`: `check_params` passed on
    this very object already (another prompt of the same call), so only what depends on the prompt is checked.
    """
    if not params_checked:
        check_params(params)
    input_len, max_seq_len = len(input_ids), limits.max_seq_len
    if input_len == 0:
        raise RequestError("the prompt is empty; send at least one token", None, "empty_prompt")
    # the length first: it costs nothing, and a huge prompt is refused before it is read
    if input_len >= max_seq_len:
        raise prompt_too_long(input_len, max_seq_len)
    vocab = limits.vocab_size
    if min(input_ids) < 0 or max(input_ids) >= vocab:
        raise RequestError(
            f"the prompt has token ids outside the vocabulary; each must be in [0, {vocab})",
            None,
            "invalid_token_ids",
        )
    outside = [t for t in params.logit_bias if t >= vocab]
    if outside:
        raise RequestError(
            f"logit_bias has token ids outside the vocabulary ({outside[0]} among them); each must be in [0, {vocab})",
            "logit_bias",
            "invalid_logit_bias",
        )
    allowed = params.allowed_token_ids
    if allowed is not None and max(allowed) >= vocab:
        raise RequestError(
            f"allowed_token_ids has token ids outside the vocabulary ({max(allowed)} among them); each must be "
            f"in [0, {vocab})",
            "allowed_token_ids",
            "invalid_allowed_token_ids",
        )
    max_tokens = min(params.max_tokens, max_seq_len - input_len)
    pool = limits.num_pages * limits.page_size
    # the same whole pages PrefillAdder asks for, so a request that passes here is admitted once the pool is idle
    if div_ceil(input_len + max_tokens, limits.page_size) > limits.num_pages:
        room = pool - input_len
        fix = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
        raise RequestError(
            f"the prompt ({input_len} tokens) plus max_tokens ({max_tokens}) needs {input_len + max_tokens} "
            f"tokens of KV cache, but the whole pool holds {pool}; {fix}",
            None,
            "context_length_exceeded",
        )
    return max_tokens


def prompt_too_long(input_len: int, max_seq_len: int, at_least: bool = False) -> RequestError:
    """The error of a prompt of `input_len` tokens (`at_least`: more than that) that a model of context
    length `max_seq_len` cannot take."""
    count = f"more than {input_len}" if at_least else f"{input_len}"
    return RequestError(
        f"the prompt has {count} tokens; this model takes at most {max_seq_len - 1} prompt tokens "
        f"(context length {max_seq_len}, one token left to generate). Shorten the prompt.",
        None,
        "context_length_exceeded",
    )
