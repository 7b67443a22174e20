"""Messages between the API server and the tokenizer worker, and the scheduler's load report."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from minisgl.core import SamplingParams

T = TypeVar("T")


@dataclass
class TokenizeMsg:
    """One prompt and its choices: choice i is the request `uids[i]`, sampled with `sampling_params[i]`.

    The prompt travels and is tokenized once however many choices it has. Exactly one of `text`,
    `input_ids` and `messages` is the prompt.
    """

    sampling_params: list[SamplingParams]
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # a chat, rendered with the model's chat template
    tools: list[dict[str, Any]] | None = None  # the chat's tools, given to the chat template
    uids: list[int] = field(default_factory=list)  # assigned by EngineClient.submit
    # how the chat template ends the prompt: a new assistant message, or the last message continued
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    documents: list[dict[str, str]] | None = None  # vLLM's: for a template that writes them (RAG templates)
    add_special_tokens: bool = True  # for `text`: the tokenizer's BOS and the like, as `encode` adds them
    return_prompt: bool = False  # the first reply of each choice carries the prompt's token ids and text
    # a chat whose reasoning is split from its answer (the reasoning format's name): the first reply says
    # whether the prompt opens it
    reasoning: str | None = None
    priority: int = 0  # the choices' place in the scheduler's queue (UserMsg.priority)
    # vLLM's truncate_prompt_tokens: only the prompt's last this many tokens are kept (None: all)
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None  # the choices' prefix cache namespace (UserMsg.cache_salt)


@dataclass
class AbortMsg:
    uid: int


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None only for a prompt's first token, which nothing comes before
    # the most likely tokens at this position, most likely first
    top: list[TokenLogprob] = field(default_factory=list)
    rank: int | None = None  # 1 + the tokens more likely than this one, where it is known (prompt tokens)


@dataclass
class UserReply:
    """What one request produced since its last reply; `text` is new text only."""

    uid: int
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    error: str | None = None
    error_code: str | None = None  # e.g. "context_length_exceeded", for the API's error body
    prompt_tokens: int = 0  # sent with the first reply
    cached_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks
    # the new tokens: the output's, then the stop token that ended it (which is not in the text)
    token_ids: list[int] | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended the request
    matched_eos: bool = False  # that token is an EOS (not one of the request's stop_token_ids)
    # with the first reply: the prompt (when TokenizeMsg.return_prompt) and one entry per prompt token
    # (when prompt_logprobs is set; the first with no log-probability)
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    # with the first reply, when TokenizeMsg.reasoning is set: the prompt ends inside a reasoning block
    reasoning_open: bool | None = None
    # with TokenizeMsg.reasoning, where the tags are tokens of the vocabulary: the output's tokens of reasoning so far
    reasoning_tokens: int | None = None


def merge_replies(first: UserReply, later: UserReply) -> UserReply:
    """One reply saying what `first` and then `later` (of the same request) said: text, log-probabilities
    and token ids add up, the counts and the finish are the later's, the prompt's fields the first's."""
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
        reasoning_open=first.reasoning_open if first.reasoning_open is not None else later.reasoning_open,
    )


def _joined(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    if a is None:
        return b
    return a if b is None else a + b


@dataclass
class TokensMsg:
    """A /tokenize or /detokenize call: the worker answers with a TokensReply of the same uid and sends
    nothing to the scheduler. Exactly one of `texts`, `messages` and `token_ids` is set."""

    uid: int
    texts: list[str] | None = None  # each tokenized alone
    messages: list[dict[str, Any]] | None = None  # one chat, rendered with the model's chat template
    token_ids: list[list[int]] | None = None  # each decoded alone
    add_special_tokens: bool = True  # for `texts`: the tokenizer's BOS and the like
    add_generation_prompt: bool = True  # for `messages`: end with the assistant's turn opened
    chat_template_kwargs: dict[str, Any] | None = None  # for `messages`: more variables for the chat template
    with_pieces: bool = False  # also each token's string in the vocabulary
    skip_special_tokens: bool = False  # for `token_ids`: leave control tokens out of the text


@dataclass
class TokensReply:
    uid: int
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    pieces: list[list[str]] | None = None
    error: str | None = None
    error_code: str | None = None


@dataclass
class SchedulerStats:
    """The scheduler's load after a step, for /metrics."""

    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    kv_pages_cached: int = 0  # owned by the prefix cache
    kv_pages_held: int = 0  # private to running requests
    kv_pages_evictable: int = 0  # cached pages no running request uses: free to take back
    page_size: int = 1
