"""The HTTP API (FastAPI): OpenAI's /v1/chat/completions, /v1/completions, /v1/responses (server/responses.py)
and /v1/models, SGLang's /generate, /tokenize and /detokenize (server/tokens_api.py), /get_model_info and
/health_generate, and /health, /version and /metrics.

Every call becomes a RequestGroup of sub-requests (prompts x choices). The server waits for each
sub-request's first reply before it answers, so a prompt the model cannot take is a 400 with an
OpenAI-style error body even when the client asked for a stream. A client that hangs up closes
its group, which aborts the sub-requests and frees their slots and pages.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minisgl
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.message.frontend import TokenizeMsg, TokenLogprob, TokensMsg, TokensReply, UserReply
from minisgl.params import choice_params
from minisgl.server.auth import ApiKeyGuard
from minisgl.server.client import EngineClient, EngineUnavailable, RequestGroup, ServeInfo
from minisgl.server.coalesce import coalesce
from minisgl.server.guard import BodyBudget, HttpLimits, RequestGuard, release_body
from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Prompt,
    check_call_size,
    parse_body,
    queue_priority,
    refuse_many_prompt_lists,
)
from minisgl.server.responses import (
    ResponsesRequest,
    ResponseStream,
    chat_tool_choice,
    chat_tools,
    output_items,
    responses_param,
    status_of,
)
from minisgl.server.responses import usage as response_usage
from minisgl.server.tokens_api import DetokenizeRequest, TokenizeRequest
from minisgl.server.tools import (
    ToolPlan,
    answer_message,
    chat_messages,
    finish_reason,
    plan_tools,
    stream_delta,
)
from minisgl.tokenizer import template_kwargs
from minisgl.tokenizer.reasoning import ReasoningFormat, ReasoningParser
from minisgl.tokenizer.tokenize import DOCUMENTS_CODE, TRUNCATE_CODE
from minisgl.tokenizer.tool_parser import ToolCallParser


@dataclass
class Choice:
    """What one sub-request has produced so far."""

    # the text in the pieces it came in, joined when read: appending each token to one string attribute
    # would copy the whole answer at every token (quadratic in a long answer)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # where the next token's text starts, for the completions logprobs
    token_ids: list[int] = field(default_factory=list)
    matched_stop: int | str | None = None
    matched_eos: bool = False
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning_open: bool | None = None
    reasoning_tokens: int | None = None  # where the worker counts them (UserReply.reasoning_tokens)

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts[:] = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    def add(self, reply: UserReply) -> None:
        if reply.text:
            self.text_parts.append(reply.text)
        self.prompt_tokens, self.cached_tokens = reply.prompt_tokens, reply.cached_tokens
        self.completion_tokens = reply.completion_tokens
        self.logprobs += reply.logprobs or []
        self.token_ids += reply.token_ids or []
        if reply.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_text = reply.prompt_token_ids, reply.prompt_text
        if reply.prompt_logprobs is not None:
            self.prompt_logprobs = reply.prompt_logprobs
        if reply.reasoning_open is not None:
            self.reasoning_open = reply.reasoning_open
        if reply.reasoning_tokens is not None:
            self.reasoning_tokens = reply.reasoning_tokens
        if reply.finished:
            self.finish_reason, self.error = reply.finish_reason, reply.error
            self.matched_stop, self.matched_eos = reply.matched_stop, reply.matched_eos

    @property
    def stop_reason(self) -> int | str | None:
        return _stop_reason(self)


def _stop_reason(c: Choice | UserReply) -> int | str | None:
    """vLLM's stop_reason: the stop string or stop_token_ids id that ended the choice (None for EOS)."""
    return None if c.matched_eos else c.matched_stop


def _usage(choices: list[Choice], n: int) -> dict[str, Any]:
    # the prompt is counted once per prompt, not once per choice of it
    prompt = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return _with_reasoning(usage, [c.reasoning_tokens for c in choices])


def _choice_usage(reply: UserReply) -> dict[str, Any]:
    """One choice's usage so far, for stream_options.continuous_usage_stats."""
    usage = {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }
    return _with_reasoning(usage, [reply.reasoning_tokens])


def _with_reasoning(usage: dict[str, Any], counts: list[int | None]) -> dict[str, Any]:
    """OpenAI's completion_tokens_details.reasoning_tokens, where the reasoning was counted (a chat split by a
    reasoning parser whose tags are tokens)."""
    if any(n is not None for n in counts):
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(n or 0 for n in counts)}
    return usage


def system_fingerprint(model: str, max_seq_len: int) -> str:
    """OpenAI's system_fingerprint: the same for every answer of one build serving one model."""
    key = f"{minisgl.__version__}|{model}|{max_seq_len}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _name(t: TokenLogprob, as_ids: bool) -> str:
    """A token as logprobs show it: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids), which
    any JSON carries and tells tokens of the same text apart."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def _prompt_logprobs(
    entries: list[TokenLogprob] | None, as_ids: bool = False
) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: None for the first token (nothing comes before it), then {token id:
    {logprob, rank, decoded_token}} of the prompt token and the most likely ones."""
    if entries is None:
        return None

    def one(t: TokenLogprob) -> dict[str, Any] | None:
        if t.logprob is None:
            return None
        out = {
            str(x.token_id): {"logprob": x.logprob, "rank": r, "decoded_token": _name(x, as_ids)}
            for r, x in enumerate(t.top, 1)
        }
        out[str(t.token_id)] = {"logprob": t.logprob, "rank": t.rank, "decoded_token": _name(t, as_ids)}
        return out

    return [one(t) for t in entries]


# made once: json.dumps with options builds a new encoder on every call, and a stream encodes every chunk
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _sse(obj: Any) -> str:
    return f"data: {_encode_json(obj)}\n\n"


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class _Format:
    """How one endpoint shapes its answer; `prompt_param` is the field a prompt error points at."""

    prompt_param = "prompt"
    sampling_prefix = ""  # where the body's sampling parameters are
    id_prefix = "cmpl"
    object = "text_completion"

    def __init__(
        self,
        model: str,
        n: int,
        include_usage: bool,
        fingerprint: str | None = None,
        continuous_usage: bool = False,
        return_token_ids: bool = False,
        logprobs_asked: bool = False,
        request_id: str | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        # vLLM's request_id: the client's name for the call, in the answer's id and the server's log
        self.id = f"{self.id_prefix}-{request_id if request_id is not None else uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.n, self.include_usage = model, n, include_usage
        self.fingerprint, self.continuous_usage = fingerprint, continuous_usage
        self.return_token_ids, self.logprobs_asked = return_token_ids, logprobs_asked
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs name tokens by id

    def view(self, reply: UserReply) -> UserReply:
        """The reply as this call shows it (a call of echo alone leaves the generated token out)."""
        return reply

    @property
    def request_id(self) -> str | None:
        """The call's name in the server's log."""
        return self.id

    def bind(self, group: RequestGroup) -> None:
        """The call's sub-requests have been submitted as `group`."""

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> Any:
        raise NotImplementedError

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        return self._envelope([], usage=_usage(choices, self.n))

    def sse(self, event: dict[str, Any]) -> str:
        """One event of the stream as it is written."""
        return _sse(event)

    def error_event(self, body: dict[str, Any]) -> dict[str, Any]:
        """The event of an error once the stream has started (an API error body)."""
        return body

    def end(self, choices: list[Choice]) -> list[str]:
        """What the stream ends with once every choice has: the usage chunk where asked for, and [DONE]."""
        usage = self.usage_chunk(choices)
        return ([] if usage is None else [_sse(usage)]) + ["data: [DONE]\n\n"]

    def _envelope(
        self, choices: list[dict[str, Any]], reply: UserReply | None = None, **extra: Any
    ) -> dict[str, Any]:
        """A stream chunk; `reply` is the one it shows, whose usage goes on it with continuous_usage."""
        out = self._head()
        out["choices"] = choices
        if self.include_usage:
            out["usage"] = None
        if self.continuous_usage and reply is not None:
            out["usage"] = _choice_usage(reply)
        out.update(extra)
        return out

    def _head(self) -> dict[str, Any]:
        """What every answer and chunk starts with."""
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out


class ChatFormat(_Format):
    prompt_param = "messages"
    id_prefix = "chatcmpl"
    object = "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        n: int,
        include_usage: bool,
        tools: ToolPlan | None = None,
        reasoning: ReasoningFormat | None = None,
        stream_reasoning: bool = True,
        echo: str = "",
        **options: Any,
    ) -> None:
        """`echo`: the text each choice's content starts with (vLLM's echo: the assistant message continued)."""
        super().__init__(model, n, include_usage, **options)
        self.tools = tools or ToolPlan()
        self.reasoning, self.stream_reasoning = reasoning, stream_reasoning
        self.echo = echo
        self._parsers: dict[int, ToolCallParser] = {}
        self._reasoners: dict[int, ReasoningParser] = {}

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        out = []
        if reply.completion_tokens > 0 and choice.completion_tokens == 0:
            first = self._choice(i, reply, {"role": "assistant", "content": ""})
            if self.return_token_ids and reply.prompt_token_ids is not None:
                first["prompt_token_ids"] = reply.prompt_token_ids
            if reply.prompt_logprobs is not None:
                first["prompt_logprobs"] = _prompt_logprobs(reply.prompt_logprobs, self.tokens_as_ids)
            out.append(first)
            if self.echo:
                out.append(self._choice(i, reply, {"content": self.echo}))
        with_ids = self.return_token_ids and bool(reply.token_ids)
        reasoning, text = self._split(i, reply)
        # under both names: SGLang's and DeepSeek's reasoning_content, and vLLM's newer reasoning
        deltas: list[dict[str, Any]] = (
            [{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []
        )
        fmt, has_calls = self.tools.format, False
        if fmt is None:
            if text or (not deltas and (reply.logprobs or with_ids)):
                deltas.append({"content": text})
        else:
            parser = self._parsers.setdefault(i, ToolCallParser(fmt, self.tools.max_calls))
            deltas += [stream_delta(d) for d in parser.feed(text)]
            if reply.finished:
                deltas += [stream_delta(d) for d in parser.finish()]
            if (reply.logprobs or with_ids) and not deltas:
                deltas = [{}]  # the tokens' logprobs and ids come although their text is held back
            has_calls = bool(parser.calls)
        for k, delta in enumerate(deltas):
            # the step's logprobs and token ids go on its first chunk
            entry = self._choice(i, reply, delta, reply.logprobs if k == 0 else None)
            if self.return_token_ids:
                entry["choices"][0]["token_ids"] = (reply.token_ids or []) if k == 0 else []
            out.append(entry)
        if reply.finished:
            out.append(
                self._choice(
                    i,
                    reply,
                    {},
                    finish_reason=finish_reason(reply.finish_reason, has_calls),
                    stop_reason=_stop_reason(reply),
                )
            )
        return out

    def _split(self, i: int, reply: UserReply) -> tuple[str, str]:
        return _split_reasoning(self._reasoners, i, self.reasoning, reply, self.stream_reasoning)

    def _choice(
        self,
        i: int,
        reply: UserReply,
        delta: dict[str, Any],
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: Any = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        entry = {
            "index": i,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs, self.tokens_as_ids),
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            entry["stop_reason"] = stop_reason
        return self._envelope([entry], reply)

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        entries = []
        for i, c in enumerate(choices):
            text, reasoning = c.text, None
            if self.reasoning is not None:
                reasoning, text = ReasoningParser(self.reasoning, bool(c.reasoning_open)).step(text, True)
            message, has_calls = answer_message(text, self.tools)
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            if self.reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning or None
            entry = {
                "index": i,
                "message": message,
                # asked for and empty (a choice of no tokens) is an empty list, not null
                "logprobs": (
                    _chat_logprobs(c.logprobs, self.tokens_as_ids)
                    if c.logprobs or self.logprobs_asked
                    else None
                ),
                "finish_reason": finish_reason(c.finish_reason, has_calls),
                "stop_reason": c.stop_reason,
            }
            if self.return_token_ids:
                entry["token_ids"] = c.token_ids
            entries.append(entry)
        out = self._head() | {
            "object": "chat.completion",
            "choices": entries,
            "usage": _usage(choices, self.n),
        }
        if self.return_token_ids:
            out["prompt_token_ids"] = choices[0].prompt_token_ids
        if choices[0].prompt_logprobs is not None:
            out["prompt_logprobs"] = _prompt_logprobs(choices[0].prompt_logprobs, self.tokens_as_ids)
        return out


def _split_reasoning(
    parsers: dict[int, ReasoningParser],
    i: int,
    fmt: ReasoningFormat | None,
    reply: UserReply,
    stream: bool = True,
) -> tuple[str, str]:
    """Choice i's new text as (reasoning, answer), its parser in `parsers`; all answer when `fmt` is None."""
    if fmt is None:
        return "", reply.text
    parser = parsers.get(i)
    if parser is None:  # this is the choice's first reply, which says where the prompt left off
        parser = parsers[i] = ReasoningParser(fmt, bool(reply.reasoning_open), stream)
    return parser.step(reply.text, reply.finished)


def _chat_logprobs(logprobs: list[TokenLogprob] | None, as_ids: bool = False) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(t: TokenLogprob) -> dict[str, Any]:
        name = _name(t, as_ids)
        return {"token": name, "logprob": t.logprob, "bytes": _bytes(name)}

    return {"content": [entry(t) | {"top_logprobs": [entry(x) for x in t.top]} for t in logprobs]}


class CompletionFormat(_Format):
    """`echo`: the prompt comes first in the text (and its tokens first in the logprobs); `echo_only`
    (max_tokens 0): the prompt alone, the one token generated to get there left out."""

    def __init__(
        self,
        *args: Any,
        echo: bool = False,
        echo_only: bool = False,
        show_prompt_logprobs: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.echo, self.echo_only = echo, echo_only
        # echo with logprobs computes prompt logprobs too; the field shows only when asked for by name
        self.show_prompt_logprobs = show_prompt_logprobs

    def view(self, reply: UserReply) -> UserReply:
        if not self.echo_only:
            return reply
        reason = "length" if reply.finish_reason in ("stop", "length") else reply.finish_reason
        return replace(
            reply,
            text="",
            completion_tokens=0,
            logprobs=None,
            token_ids=None,
            finish_reason=reason,
            matched_stop=None,
            matched_eos=False,
        )

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        head = self.echo and reply.prompt_text is not None
        # a token whose text is empty yet (part of a character) still shows its id when ids are asked
        with_ids = self.return_token_ids and bool(reply.token_ids)
        if not (reply.text or reply.logprobs or reply.finished or head or with_ids):
            return []
        text, logprobs = reply.text, reply.logprobs
        if head:
            text = (reply.prompt_text or "") + text
            logprobs = (reply.prompt_logprobs or []) + (logprobs or []) if self.logprobs_asked else logprobs
        entry: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": _completion_logprobs(logprobs, choice, head, self.tokens_as_ids),
            "finish_reason": reply.finish_reason if reply.finished else None,
        }
        if reply.finished:
            entry["stop_reason"] = _stop_reason(reply)
        if self.return_token_ids:
            entry["token_ids"] = reply.token_ids or []
            if reply.prompt_token_ids is not None:
                entry["prompt_token_ids"] = reply.prompt_token_ids
        if self.show_prompt_logprobs and reply.prompt_logprobs is not None:
            entry["prompt_logprobs"] = _prompt_logprobs(reply.prompt_logprobs, self.tokens_as_ids)
        return [self._envelope([entry], reply)]

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        entries = []
        for i, c in enumerate(choices):
            text, logprobs = c.text, c.logprobs
            if self.echo:
                text = (c.prompt_text or "") + text
                # the prompt's tokens first: the first of them has no log-probability (None)
                logprobs = (c.prompt_logprobs or []) + logprobs if self.logprobs_asked else logprobs
            asked = self.logprobs_asked or bool(logprobs)
            entry: dict[str, Any] = {
                "index": i,
                "text": text,
                "logprobs": _completion_logprobs(logprobs, Choice(), self.echo, self.tokens_as_ids)
                if asked
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self.return_token_ids:
                entry["prompt_token_ids"], entry["token_ids"] = c.prompt_token_ids, c.token_ids
            if self.show_prompt_logprobs:
                entry["prompt_logprobs"] = _prompt_logprobs(c.prompt_logprobs, self.tokens_as_ids)
            entries.append(entry)
        return self._head() | {
            "object": "text_completion",
            "choices": entries,
            "usage": _usage(choices, self.n),
        }


def _completion_logprobs(
    logprobs: list[TokenLogprob] | None, choice: Choice, first_is_prompt: bool = False, as_ids: bool = False
) -> dict[str, Any] | None:
    """The legacy completions shape; `choice` keeps the text offset across stream chunks.

    Each top_logprobs entry holds the chosen token too (so logprobs=0 gives the chosen token alone, as
    OpenAI and vLLM do); with echo the prompt's first token has no log-probability and no top entry.
    """
    if logprobs is None:
        return None
    offsets = []
    for t in logprobs:
        offsets.append(choice.text_offset)
        choice.text_offset += len(t.token)
    tops: list[dict[str, float] | None] = []
    for t in logprobs:
        # tokens with the same text share a key: the most likely one keeps it
        top = {_name(x, as_ids): x.logprob for x in reversed(t.top)}
        top.setdefault(_name(t, as_ids), t.logprob)
        tops.append(top)
    if first_is_prompt and logprobs and logprobs[0].logprob is None:
        tops[0] = None
    return {
        "tokens": [_name(t, as_ids) for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


class ResponsesFormat(_Format):
    """OpenAI's Responses API (server/responses.py): one choice, answered as a response object with output
    items, streamed as response.* events."""

    prompt_param = "input"
    id_prefix = "resp"
    object = "response"

    def __init__(
        self,
        model: str,
        req: Any,
        params: SamplingParams,
        reasoning: ReasoningFormat | None,
        tools: ToolPlan,
        request_id: str | None,
    ) -> None:
        super().__init__(model, 1, include_usage=False, request_id=request_id)
        self.id = f"resp_{request_id if request_id is not None else uuid.uuid4().hex}"  # OpenAI's spelling
        self.req, self.params, self.reasoning, self.tools = req, params, reasoning, tools
        self._reasoners: dict[int, ReasoningParser] = {}
        self._calls = None if tools.format is None else ToolCallParser(tools.format, tools.max_calls)
        self._stream: ResponseStream | None = None

    def head(self) -> dict[str, Any]:
        """The response object less its status, output and usage: what the request set."""
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "in_progress",
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "background": False,
            "previous_response_id": None,
            "reasoning": None,
            "user": req.user,
            "usage": None,
        }

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        out = []
        if self._stream is None:
            self._stream = ResponseStream(self.head())
            out += self._stream.start()
        reasoning, text = _split_reasoning(self._reasoners, i, self.reasoning, reply)
        if self._calls is None:
            out += self._stream.feed(reasoning, text, self._logprobs(reply.logprobs))
        else:
            out += self._stream.feed(reasoning, "")
            pieces = self._calls.feed(text) + (self._calls.finish() if reply.finished else [])
            for piece in pieces:
                if isinstance(piece, str):
                    out += self._stream.feed("", piece)
                else:
                    out += self._stream.call(piece.index, piece.id, piece.name, piece.arguments)
        if reply.finished and reply.finish_reason != "error":
            status, incomplete = status_of(reply.finish_reason)
            counts = reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens, reply.reasoning_tokens
            out += self._stream.finish(status, incomplete, response_usage(*counts))
        return out

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        c = choices[0]
        reasoning, text = "", c.text
        if self.reasoning is not None:
            reasoning, text = ReasoningParser(self.reasoning, bool(c.reasoning_open)).step(text, True)
        status, incomplete = status_of(c.finish_reason)
        message, _ = answer_message(text, self.tools)
        output = output_items(reasoning, message, status, self._logprobs(c.logprobs))
        counts = c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.reasoning_tokens
        return self.head() | {
            "status": status,
            "incomplete_details": incomplete,
            "output": output,
            "usage": response_usage(*counts),
        }

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
        """The tokens' log-probabilities as output_text parts carry them (chat's entries), where asked for."""
        shown = _chat_logprobs(logprobs) if self.req.logprobs else None
        return None if shown is None else shown["content"]

    def sse(self, event: dict[str, Any]) -> str:
        return f"event: {event['type']}\n{_sse(event)}"

    def error_event(self, body: dict[str, Any]) -> dict[str, Any]:
        error = body["error"]
        seq = self._stream.seq if self._stream is not None else 0
        return {"type": "error", "code": error["code"], "message": error["message"], "param": error["param"],
                "sequence_number": seq}  # fmt: skip

    def end(self, choices: list[Choice]) -> list[str]:
        return []  # the last event said so (response.completed, .incomplete or .failed); no [DONE]


class GenerateFormat(_Format):
    """SGLang's /generate: text (the whole text so far, also when streaming) and meta_info."""

    prompt_param = "text"
    sampling_prefix = "sampling_params."

    def __init__(
        self,
        model: str,
        n: int,
        batch: bool,
        prompt_param: str,
        rids: list[str] | None = None,
        texts_in_logprobs: bool = True,
        input_logprobs_from: int = 0,
    ) -> None:
        """`rids`: SGLang's rid, one a prompt (None: the uids); `texts_in_logprobs`: return_text_in_logprobs;
        `input_logprobs_from`: logprob_start_len, the first prompt position whose entry is given."""
        super().__init__(model, n, include_usage=False)
        self.batch, self.prompt_param = batch, prompt_param
        self.rids, self.texts_in_logprobs = rids, texts_in_logprobs
        self.input_logprobs_from = input_logprobs_from
        self.uids: list[int] = []
        self.arrival = 0.0

    @property
    def request_id(self) -> str | None:
        # in the log as in meta_info: one prompt's rid (with each choice's index when n > 1); a batch's by uid
        return self.rids[0] if self.rids is not None and len(self.rids) == 1 else None

    def _id(self, i: int) -> str:
        """meta_info.id of sub-request i: its prompt's rid (with the choice's index when n > 1), or its uid."""
        if self.rids is None:
            return str(self.uids[i])
        rid = self.rids[i // self.n]
        return rid if self.n == 1 else f"{rid}/{i % self.n}"

    def _entry(self, t: TokenLogprob) -> list[Any]:
        return [t.logprob, t.token_id, t.token if self.texts_in_logprobs else None]

    def bind(self, group: RequestGroup) -> None:
        self.uids, self.arrival = group.uids, group.arrival

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        if not (reply.text or reply.finished):
            return []
        full = Choice([choice.text, reply.text], reply.finish_reason if reply.finished else None)
        full.prompt_tokens, full.cached_tokens = reply.prompt_tokens, reply.cached_tokens
        full.completion_tokens = reply.completion_tokens
        full.logprobs = choice.logprobs + (reply.logprobs or [])
        full.prompt_logprobs = choice.prompt_logprobs or reply.prompt_logprobs
        if reply.finished:
            full.matched_stop = reply.matched_stop
        return [self._one(i, full)]

    def _one(self, i: int, c: Choice) -> dict[str, Any]:
        reason: dict[str, Any] | None = None
        if c.finish_reason == "length":
            reason = {"type": "length", "length": c.completion_tokens}
        elif c.finish_reason is not None:
            reason = {"type": c.finish_reason, "message": c.error} if c.error else {"type": c.finish_reason}
        meta: dict[str, Any] = {
            "id": self._id(i),
            "finish_reason": reason,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "e2e_latency": time.perf_counter() - self.arrival,
        }
        if c.finish_reason == "stop":
            # SGLang's: the stop token id (an EOS among them) or stop string that ended the output
            meta["matched_stop"] = c.matched_stop
        if c.logprobs:
            meta["output_token_logprobs"] = [self._entry(t) for t in c.logprobs]
            meta["output_top_logprobs"] = [[self._entry(x) for x in t.top] for t in c.logprobs]
        if c.prompt_logprobs is not None:
            # SGLang's names; the first prompt token's log-probability is None; from logprob_start_len on (a start
            # at or past the prompt's end gives none)
            given = c.prompt_logprobs[self.input_logprobs_from :]
            meta["input_token_logprobs"] = [self._entry(t) for t in given]
            meta["input_top_logprobs"] = [
                None if t.logprob is None else [self._entry(x) for x in t.top] for t in given
            ]
        out = {"text": c.text, "meta_info": meta}
        if self.batch:
            out["index"] = i
        return out

    def response(self, choices: list[Choice]) -> Any:
        out = [self._one(i, c) for i, c in enumerate(choices)]
        return out if self.batch else out[0]


def _reply_error(reply: UserReply, fmt: _Format) -> APIError:
    if reply.error_code == "engine_unavailable":
        return APIError(
            reply.error or "the engine is unavailable", None, reply.error_code, 503, "server_error"
        )
    prompt_codes = (
        "context_length_exceeded",
        "empty_prompt",
        "invalid_token_ids",
        "invalid_messages",
        "no_chat_template",
    )
    param = fmt.prompt_param if reply.error_code in prompt_codes else None
    if reply.error_code in _VOCAB_PARAMS:  # found by the request check, which knows the vocabulary
        param = fmt.sampling_prefix + _VOCAB_PARAMS[reply.error_code]
    param = _WORKER_PARAMS.get(reply.error_code or "", param)
    return APIError(reply.error or "the request failed", param, reply.error_code)


# the sampling field at fault for what only the scheduler's request check knows (the vocabulary, and the words'
# tokens), by its code
_VOCAB_PARAMS = {
    "invalid_logit_bias": "logit_bias",
    "invalid_allowed_token_ids": "allowed_token_ids",
    "invalid_bad_words": "bad_words",
}

# the field at fault for an error only the tokenizer worker finds (it knows the chat template), by its code: for
# a generation's first reply and a /tokenize reply alike
_WORKER_PARAMS = {
    template_kwargs.CODE: template_kwargs.PARAM,
    TRUNCATE_CODE: "truncate_prompt_tokens",
    DOCUMENTS_CODE: "documents",
}


async def _close_on_disconnect(request: Request, group: RequestGroup) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    group.close()


def create_app(
    info: ServeInfo,
    make_client: Callable[[], EngineClient],
    http: HttpLimits,
    on_start: Callable[[], None] | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app; its EngineClient is made at start-up, inside the server's event loop, then `on_start` runs.
    With `api_key`, every route but /health needs it (server/auth.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = make_client()
        client.start()
        app.state.client, app.state.loop = client, asyncio.get_running_loop()
        if on_start is not None:
            on_start()
        yield
        client.close()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    bodies = app.state.bodies = BodyBudget(http.max_request_bytes_in_flight)
    app.add_middleware(RequestGuard, limits=http, budget=bodies)
    if api_key is not None:
        # added last, so it runs first: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyGuard, api_key=api_key)

    def client_of(request: Request) -> EngineClient:
        return request.app.state.client

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(f"{request.method} {request.url.path}: {exc.detail}", None, None, exc.status_code)
        return JSONResponse(error.body(), status_code=exc.status_code)

    def model_of(name: str | None) -> str:
        """The model name the answer carries: the one the request named (any served name), else the first."""
        if name is None:
            return info.model_name
        if not info.accepts(name):
            names = ", ".join(repr(n) for n in info.served_names)
            raise APIError(
                f"the model {name!r} does not exist; this server serves {names}",
                "model",
                "model_not_found",
                404,
            )
        return name

    async def serve(request: Request, msgs: list[TokenizeMsg], fmt: _Format, stream: bool) -> Response:
        client = client_of(request)
        try:
            group = client.submit(msgs, fmt.request_id)
        except EngineUnavailable as e:
            raise APIError(str(e), None, "engine_unavailable", 503, "server_error") from e
        fmt.bind(group)
        watcher = asyncio.create_task(_close_on_disconnect(request, group))
        streaming = False
        try:
            first = await _first_replies(group, fmt)
            # after the first replies: a call of thousands of prompts refused there builds none
            choices = [Choice() for _ in group.uids]
            if stream:
                streaming = True  # the stream owns the group and the watcher from here
                return StreamingResponse(
                    _stream(group, watcher, first, choices, fmt),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            for i, reply in first:
                choices[i].add(fmt.view(reply))
            while any(c.finish_reason is None for c in choices):
                i, reply = await group.get()
                choices[i].add(fmt.view(reply))
            failed = next((c for c in choices if c.finish_reason == "error"), None)
            if failed is not None:
                code = "engine_unavailable" if client.failure else None
                raise _reply_error(UserReply(0, "", True, "error", failed.error, code), fmt)
            return JSONResponse(fmt.response(choices))
        finally:
            if not streaming:
                watcher.cancel()
                group.close()

    @app.get("/health")
    async def health(request: Request) -> Response:
        failure = client_of(request).failure
        if failure is not None:
            return JSONResponse(APIError(failure, None, "engine_unavailable", 503).body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """SGLang's deeper check: the engine generates. A one-token request is sent; the answer is 200 once it
        finishes, or as soon as the engine gives other requests tokens meanwhile (a busy engine is alive even
        where the check waits in its queue), 503 after MINISGL_HEALTH_GENERATE_TIMEOUT seconds without either."""
        client = client_of(request)
        before = client.metrics.generation_tokens
        try:
            group = client.submit(
                [TokenizeMsg([SamplingParams(max_tokens=1)], input_ids=[0])], "health_generate"
            )
        except EngineUnavailable as e:
            raise APIError(str(e), None, "engine_unavailable", 503, "server_error") from e
        wait_s = ENV.HEALTH_GENERATE_TIMEOUT.value
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    _, reply = await asyncio.wait_for(group.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    if client.metrics.generation_tokens > before:
                        return JSONResponse({"status": "ok"})
                    if time.monotonic() > deadline:
                        error = f"the engine generated nothing in {wait_s} s"
                        raise APIError(error, None, "engine_unavailable", 503, "server_error") from None
                    continue
                if reply.finish_reason == "error":
                    raise APIError(reply.error or "", None, "engine_unavailable", 503, "server_error")
                if reply.finished:
                    return JSONResponse({"status": "ok"})
        finally:
            group.close()

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        """SGLang's: the server's options (the API key left out), its version, the KV pool's size in tokens
        and, as SGLang's benchmarks read it, the recent generation throughput."""
        client = client_of(request)
        stats = client.metrics.scheduler
        throughput = client.metrics.gen_throughput(time.perf_counter())
        return {
            **info.server_args,
            "version": minisgl.__version__,
            "max_total_num_tokens": stats.kv_pages_total * stats.page_size,
            "max_model_len": info.max_seq_len,
            "internal_states": [{"last_gen_throughput": throughput}],
        }

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        """SGLang's: what SGLang's clients read at connection (its frontend language's RuntimeEndpoint)."""
        return {
            "model_path": info.model_path if info.model_path is not None else info.model_name,
            "tokenizer_path": info.model_path if info.model_path is not None else info.model_name,
            "is_generation": True,
            "served_model_names": info.served_names,
            "max_model_len": info.max_seq_len,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/reset_prefix_cache")
    async def flush_cache(request: Request) -> Response:
        """SGLang's /flush_cache and vLLM's /reset_prefix_cache: the prefix cache emptied, so that the next
        request computes its whole prompt (a benchmark's cold start); refused while requests run or wait."""
        try:
            reply = await client_of(request).flush_cache()
        except EngineUnavailable as e:
            raise APIError(str(e), None, "engine_unavailable", 503, "server_error") from e
        if reply.error is not None:
            raise APIError(f"the prefix cache was not flushed: {reply.error}", None, "server_busy", 400)
        return JSONResponse({"status": "ok", "freed_pages": reply.freed_pages})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        text = client_of(request).metrics.render(body_bytes_held=bodies.held)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def model_entry(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "minisgl",
            "max_model_len": info.max_seq_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_entry(name) for name in info.served_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return model_entry(model_of(model_id))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minisgl.__version__}

    fingerprint = system_fingerprint(info.model_name, info.max_seq_len)

    def within_context(max_tokens: int | None, param: str) -> None:
        """max_tokens that no prompt leaves room for is a 400 (a smaller one is cut to what the prompt leaves)."""
        if max_tokens is not None and max_tokens >= info.max_seq_len:
            raise APIError(
                f"{param}={max_tokens} is more than this model's context length leaves for output "
                f"({info.max_seq_len} tokens, at least one of them the prompt); lower {param}",
                param,
                "context_length_exceeded",
            )

    def format_options(req: Any) -> dict[str, Any]:
        return {
            "fingerprint": fingerprint,
            "continuous_usage": req.continuous_usage,
            "return_token_ids": bool(req.return_token_ids),
            "request_id": req.checked_request_id(),
            "tokens_as_ids": bool(req.return_tokens_as_token_ids),
        }

    async def tokens(request: Request, msg: TokensMsg, param: str) -> TokensReply:
        try:
            reply = await client_of(request).tokens(msg)
        except EngineUnavailable as e:
            raise APIError(str(e), None, "engine_unavailable", 503, "server_error") from e
        if reply.error is not None:
            raise APIError(reply.error, _WORKER_PARAMS.get(reply.error_code or "", param), reply.error_code)
        return reply

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await read_request(request, lambda b: parse_body(TokenizeRequest, b, info.max_seq_len))
        model_of(req.model)
        reply = await tokens(request, req.to_msg(), "prompt" if req.prompt is not None else "messages")
        # a JSONResponse as it is: FastAPI's encoder walks a batch's ids in Python, on the event loop
        return JSONResponse(req.response(reply, info.max_seq_len))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await read_request(request, lambda b: parse_body(DetokenizeRequest, b))
        model_of(req.model)
        return JSONResponse(req.response(await tokens(request, req.to_msg(), "tokens")))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, *await read_request(request, chat_call))

    def context_of(body: bytes) -> int | None:
        """The context length a prompt is refused against as the body is read: none where the body may ask
        for truncate_prompt_tokens, as a truncated prompt may be longer (the tokenizer checks what is kept)."""
        return None if b"truncate_prompt_tokens" in body else info.max_seq_len

    def chat_call(body: bytes) -> Call:
        req = parse_body(ChatCompletionRequest, body, context_of(body))
        req.check_fields()
        model = model_of(req.model)
        texts, n = req.chat(), req.num_choices
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, info.tools)
        reasoning, stream_reasoning = req.reasoning_plan(info.reasoning)
        messages = tools.messages(chat_messages(texts, req.messages))
        params = tools.constrain(req.sampling_params())
        if req.max_completion_tokens is not None:
            within_context(req.max_completion_tokens, "max_completion_tokens")
        else:
            within_context(req.max_tokens, "max_tokens")
        msg = TokenizeMsg(
            choice_params(params, n),
            messages=messages,
            tools=tools.template_tools,
            return_prompt=bool(req.return_token_ids),
            chat_template_kwargs=req.chat_template_kwargs or None,
            documents=req.checked_documents(),
            reasoning=None if reasoning is None else reasoning.name,
            priority=queue_priority(req.priority, info.priority_scheduling),
            truncate_prompt_tokens=req.kept_prompt_tokens(info.max_seq_len, params.max_tokens),
            cache_salt=req.cache_salt,
            **req.template_options,
        )
        fmt = ChatFormat(
            model,
            n,
            req.include_usage,
            tools,
            reasoning,
            stream_reasoning,
            echo=req.echoed(texts),
            logprobs_asked=params.logprobs is not None,
            **format_options(req),
        )
        return [msg], fmt, bool(req.stream)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(request, *await read_request(request, responses_call))

    def responses_call(body: bytes) -> Call:
        req = parse_body(ResponsesRequest, body, info.max_seq_len)
        req.check_fields()
        model = model_of(req.model)
        try:
            tools = plan_tools(
                chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls, info.tools
            )
            params = tools.constrain(req.sampling_params())
        except APIError as e:
            raise responses_param(e) from e
        within_context(req.max_output_tokens, "max_output_tokens")
        reasoning = info.reasoning
        if req.logprobs and (reasoning is not None or tools.format is not None):
            raise APIError(
                "the output text's log-probabilities are not given with a reasoning parser or tools, whose split of "
                "the text would have to split them token by token; leave include out",
                "include",
                "unsupported_parameter",
            )
        msg = TokenizeMsg(
            [params],
            messages=tools.messages(req.messages()),
            tools=tools.template_tools,
            reasoning=None if reasoning is None else reasoning.name,
            priority=queue_priority(req.priority, info.priority_scheduling),
            cache_salt=req.cache_salt,
        )
        fmt = ResponsesFormat(model, req, params, reasoning, tools, req.checked_request_id())
        return [msg], fmt, bool(req.stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, *await read_request(request, completion_call))

    def completion_call(body: bytes) -> Call:
        refuse_many_prompt_lists(body, "prompt")
        req = parse_body(CompletionRequest, body, context_of(body))
        req.check_fields()
        model = model_of(req.model)
        prompts, n = req.prompts(), req.num_choices
        check_call_size(len(prompts), n, "n")
        within_context(req.max_tokens, "max_tokens")
        params = req.sampling_params()
        if req.echo and req.logprobs is not None:
            # the prompt's tokens come with their log-probabilities, as OpenAI's echo gives them
            params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, req.logprobs))
        return_prompt = bool(req.echo or req.return_token_ids)
        special = req.add_special_tokens is not False
        priority = queue_priority(req.priority, info.priority_scheduling)
        msgs = _prompt_msgs(prompts, choice_params(params, n), return_prompt, special, priority)
        keep = req.kept_prompt_tokens(info.max_seq_len, params.max_tokens)
        for msg in msgs:
            msg.truncate_prompt_tokens, msg.cache_salt = keep, req.cache_salt
        fmt = CompletionFormat(
            model,
            n,
            req.include_usage,
            echo=bool(req.echo),
            echo_only=req.echo_only,
            show_prompt_logprobs=req.prompt_logprobs is not None,
            logprobs_asked=req.logprobs is not None,
            **format_options(req),
        )
        return msgs, fmt, bool(req.stream)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await serve(request, *await read_request(request, generate_call))

    def generate_call(body: bytes) -> Call:
        refuse_many_prompt_lists(body, "input_ids")
        req = parse_body(GenerateRequest, body, info.max_seq_len)
        prompts, n = req.prompts(), req.num_choices
        check_call_size(len(prompts), n, "sampling_params.n")
        params = req.to_sampling_params()
        if req.sampling_params is not None:
            within_context(req.sampling_params.max_new_tokens, "sampling_params.max_new_tokens")
        priority = queue_priority(req.priority, info.priority_scheduling)
        msgs = _prompt_msgs(prompts, choice_params(params, n), priority=priority)
        fmt = GenerateFormat(
            info.model_name,
            n,
            len(prompts) * n > 1,
            "text" if req.text is not None else "input_ids",
            req.request_ids(len(prompts)),
            req.return_text_in_logprobs is not False,
            req.input_logprobs_from or 0,
        )
        return msgs, fmt, bool(req.stream)

    return app


# a call checked and ready to submit: its messages, its answer's shape, whether it streams
Call = tuple[list[TokenizeMsg], _Format, bool]
R = TypeVar("R")

# Reading a request can hold the event loop, and every stream it writes, for a while: a large body is
# parsed and checked (tens of ms for a few MB; protocol.py keeps it so), and a grammar is compiled once
# to check it (3-20 ms, as texts are kept under 32 KiB). Such requests are read on a worker thread;
# small plain ones, most of them, stay on the loop, where a thread hop would cost more than the read.
_OFF_LOOP_BYTES = 64 << 10
_GRAMMAR_KEYS = (
    b'"json_schema"',
    b'"regex"',
    b'"ebnf"',
    b'"response_format"',
    b'"guided_',
    b'"structured_outputs"',
    b'"tools"',
    b'"tool_choice"',
)


async def read_request(request: Request, read: Callable[[bytes], R]) -> R:
    """read(the request's body): the one way a route reads its body. The guard (server/guard.py) has read
    it whole and hands it over as one message, kept nowhere else; once read, its bytes leave the budget of
    bodies held, as they leave memory."""
    try:
        return await off_loop(read, (await request.receive())["body"])
    finally:
        release_body(request.scope)


async def off_loop(read: Callable[[bytes], R], body: bytes) -> R:
    """read(body), on a worker thread when the body is large or may carry a grammar."""
    if len(body) > _OFF_LOOP_BYTES or any(key in body for key in _GRAMMAR_KEYS):
        return await asyncio.to_thread(read, body)
    return read(body)


def _prompt_msgs(
    prompts: list[Prompt],
    params: list[SamplingParams],
    return_prompt: bool = False,
    add_special_tokens: bool = True,
    priority: int = 0,
) -> list[TokenizeMsg]:
    """One message a prompt, carrying its choices: the group's replies come every choice of the first
    prompt, then of the next. `add_special_tokens`: for text prompts (token ids are taken as they are)."""
    return [
        TokenizeMsg(
            params,
            text=p,
            return_prompt=return_prompt,
            add_special_tokens=add_special_tokens,
            priority=priority,
        )
        if isinstance(p, str)
        else TokenizeMsg(params, input_ids=p, return_prompt=return_prompt, priority=priority)
        for p in prompts
    ]


async def _first_replies(group: RequestGroup, fmt: _Format) -> list[tuple[int, UserReply]]:
    """Wait for every sub-request's first reply; an error there is the whole call's error."""
    waiting = set(range(len(group.uids)))
    first = []
    while waiting:
        i, reply = await group.get()
        if reply.finish_reason == "error":
            raise _reply_error(reply, fmt)
        first.append((i, reply))
        waiting.discard(i)
    return first


async def _stream(
    group: RequestGroup,
    watcher: asyncio.Task[None],
    first: list[tuple[int, UserReply]],
    choices: list[Choice],
    fmt: _Format,
) -> AsyncIterator[str]:
    try:
        pending = list(first)
        while True:
            # what arrived while the last write was under way goes out as one chunk a choice, in one write
            events = []
            for i, reply in coalesce(pending):
                reply = fmt.view(reply)
                events += [fmt.sse(chunk) for chunk in fmt.chunks(i, reply, choices[i])]
                choices[i].add(reply)
                if reply.finish_reason == "error":
                    body = APIError(reply.error or "the request failed", None, reply.error_code).body()
                    events.append(fmt.sse(fmt.error_event(body)))
            if all(c.finish_reason is not None for c in choices):
                break
            if events:
                yield "".join(events)
            pending = await group.get_all()
        yield "".join(events + fmt.end(choices))
    finally:
        watcher.cancel()
        group.close()
