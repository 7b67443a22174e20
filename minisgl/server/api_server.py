"""The HTTP API (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, SGLang's
/generate, /tokenize and /detokenize (server/tokens_api.py), and /health, /version and /metrics.

Every call becomes a RequestGroup of sub-requests (prompts x choices). The server waits for each
sub-request's first reply before it answers, so a prompt the model cannot take is a 400 with an
OpenAI-style error body even when the client asked for a stream. A client that hangs up closes
its group, which aborts the sub-requests and frees their slots and pages.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minisgl
from minisgl.core import SamplingParams
from minisgl.message.frontend import TokenizeMsg, TokenLogprob, TokensMsg, TokensReply, UserReply
from minisgl.server.auth import ApiKeyGuard
from minisgl.server.client import EngineClient, EngineUnavailable, RequestGroup, ServeInfo
from minisgl.server.guard import HttpLimits, RequestGuard
from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Prompt,
    choice_params,
    parse_body,
)
from minisgl.server.tokens_api import DetokenizeRequest, TokenizeRequest


@dataclass
class Choice:
    """What one sub-request has produced so far."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # where the next token's text starts, for the completions logprobs

    def add(self, reply: UserReply) -> None:
        self.text += reply.text
        self.prompt_tokens, self.cached_tokens = reply.prompt_tokens, reply.cached_tokens
        self.completion_tokens = reply.completion_tokens
        self.logprobs += reply.logprobs or []
        if reply.finished:
            self.finish_reason, self.error = reply.finish_reason, reply.error


def _usage(choices: list[Choice], n: int) -> dict[str, Any]:
    # the prompt is counted once per prompt, not once per choice of it
    prompt = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class _Format:
    """How one endpoint shapes its answer; `prompt_param` is the field a prompt error points at."""

    prompt_param = "prompt"
    id_prefix = "cmpl"
    object = "text_completion"

    def __init__(self, model: str, n: int, include_usage: bool) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.n, self.include_usage = model, n, include_usage

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

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        out["choices"] = choices
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out


class ChatFormat(_Format):
    prompt_param = "messages"
    id_prefix = "chatcmpl"
    object = "chat.completion.chunk"

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        out = []
        if reply.completion_tokens > 0 and choice.completion_tokens == 0:
            out.append(self._choice(i, {"role": "assistant", "content": ""}))
        if reply.text or reply.logprobs:
            out.append(self._choice(i, {"content": reply.text}, reply.logprobs))
        if reply.finished:
            out.append(self._choice(i, {}, finish_reason=reply.finish_reason))
        return out

    def _choice(
        self,
        i: int,
        delta: dict[str, Any],
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: Any = None,
    ) -> dict[str, Any]:
        entry = {
            "index": i,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return self._envelope([entry])

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c.logprobs) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": _usage(choices, self.n),
        }


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if not logprobs:
        return None

    def entry(t: TokenLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token)}

    return {"content": [entry(t) | {"top_logprobs": [entry(x) for x in t.top]} for t in logprobs]}


class CompletionFormat(_Format):
    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        if not (reply.text or reply.logprobs or reply.finished):
            return []
        entry = {
            "index": i,
            "text": reply.text,
            "logprobs": _completion_logprobs(reply.logprobs, choice),
            "finish_reason": reply.finish_reason if reply.finished else None,
        }
        return [self._envelope([entry])]

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        entries = []
        for i, c in enumerate(choices):
            logprobs = _completion_logprobs(c.logprobs, Choice()) if c.logprobs else None
            entries.append(
                {"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
            )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": entries,
            "usage": _usage(choices, self.n),
        }


def _completion_logprobs(logprobs: list[TokenLogprob] | None, choice: Choice) -> dict[str, Any] | None:
    """The legacy completions shape; `choice` keeps the text offset across stream chunks."""
    if not logprobs:
        return None
    offsets = []
    for t in logprobs:
        offsets.append(choice.text_offset)
        choice.text_offset += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        # tokens with the same text share a key: the most likely one keeps it
        "top_logprobs": [{x.token: x.logprob for x in reversed(t.top)} for t in logprobs],
        "text_offset": offsets,
    }


class GenerateFormat(_Format):
    """SGLang's /generate: text (the whole text so far, also when streaming) and meta_info."""

    prompt_param = "text"

    def __init__(self, model: str, n: int, batch: bool, prompt_param: str) -> None:
        super().__init__(model, n, include_usage=False)
        self.batch, self.prompt_param = batch, prompt_param
        self.uids: list[int] = []
        self.arrival = 0.0

    @property
    def request_id(self) -> str | None:
        return None  # each sub-request is known by its uid, the meta_info id

    def bind(self, group: RequestGroup) -> None:
        self.uids, self.arrival = group.uids, group.arrival

    def chunks(self, i: int, reply: UserReply, choice: Choice) -> list[dict[str, Any]]:
        if not (reply.text or reply.finished):
            return []
        full = Choice(choice.text + reply.text, reply.finish_reason if reply.finished else None)
        full.prompt_tokens, full.cached_tokens = reply.prompt_tokens, reply.cached_tokens
        full.completion_tokens = reply.completion_tokens
        full.logprobs = choice.logprobs + (reply.logprobs or [])
        return [self._one(i, full)]

    def _one(self, i: int, c: Choice) -> dict[str, Any]:
        reason: dict[str, Any] | None = None
        if c.finish_reason == "length":
            reason = {"type": "length", "length": c.completion_tokens}
        elif c.finish_reason is not None:
            reason = {"type": c.finish_reason, "message": c.error} if c.error else {"type": c.finish_reason}
        meta: dict[str, Any] = {
            "id": str(self.uids[i]),
            "finish_reason": reason,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "e2e_latency": time.perf_counter() - self.arrival,
        }
        if c.logprobs:
            meta["output_token_logprobs"] = [[t.logprob, t.token_id, t.token] for t in c.logprobs]
            meta["output_top_logprobs"] = [
                [[x.logprob, x.token_id, x.token] for x in t.top] for t in c.logprobs
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
    return APIError(reply.error or "the request failed", param, reply.error_code)


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
    app.add_middleware(RequestGuard, limits=http)
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
            choices = [Choice() for _ in group.uids]
            first = await _first_replies(group, fmt)
            if stream:
                streaming = True  # the stream owns the group and the watcher from here
                return StreamingResponse(
                    _stream(group, watcher, first, choices, fmt),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            for i, reply in first:
                choices[i].add(reply)
            while any(c.finish_reason is None for c in choices):
                i, reply = await group.get()
                choices[i].add(reply)
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

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return PlainTextResponse(client_of(request).metrics.render(), media_type="text/plain; version=0.0.4")

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

    async def tokens(request: Request, msg: TokensMsg, param: str) -> TokensReply:
        try:
            reply = await client_of(request).tokens(msg)
        except EngineUnavailable as e:
            raise APIError(str(e), None, "engine_unavailable", 503, "server_error") from e
        if reply.error is not None:
            raise APIError(reply.error, param, reply.error_code)
        return reply

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await request.body())
        model_of(req.model)
        reply = await tokens(request, req.to_msg(), "prompt" if req.prompt is not None else "messages")
        return req.response(reply, info.max_seq_len)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await request.body())
        model_of(req.model)
        return req.response(await tokens(request, req.to_msg(), "tokens"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body())
        model = model_of(req.model)
        messages, n = req.chat(), req.num_choices
        msgs = [TokenizeMsg(choice_params(req.sampling_params(), n), messages=messages)]
        return await serve(request, msgs, ChatFormat(model, n, req.include_usage), bool(req.stream))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        model = model_of(req.model)
        prompts, n = req.prompts(), req.num_choices
        msgs = _prompt_msgs(prompts, choice_params(req.sampling_params(), n))
        return await serve(request, msgs, CompletionFormat(model, n, req.include_usage), bool(req.stream))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = parse_body(GenerateRequest, await request.body())
        prompts, n = req.prompts(), req.num_choices
        msgs = _prompt_msgs(prompts, choice_params(req.to_sampling_params(), n))
        fmt = GenerateFormat(
            info.model_name, n, len(prompts) * n > 1, "text" if req.text is not None else "input_ids"
        )
        return await serve(request, msgs, fmt, bool(req.stream))

    return app


def _prompt_msgs(prompts: list[Prompt], params: list[SamplingParams]) -> list[TokenizeMsg]:
    """One message a prompt, carrying its choices: the group's replies come every choice of the first
    prompt, then of the next."""
    return [
        TokenizeMsg(params, text=p) if isinstance(p, str) else TokenizeMsg(params, input_ids=p)
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
            for i, reply in pending:
                for chunk in fmt.chunks(i, reply, choices[i]):
                    yield _sse(chunk)
                choices[i].add(reply)
                if reply.finish_reason == "error":
                    yield _sse(APIError(reply.error or "the request failed", None, reply.error_code).body())
            if all(c.finish_reason is not None for c in choices):
                break
            pending = [await group.get()]
        usage = fmt.usage_chunk(choices)
        if usage is not None:
            yield _sse(usage)
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        group.close()
