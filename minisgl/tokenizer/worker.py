"""The tokenizer worker: prompts from the API server go to the scheduler as token ids, and the
scheduler's tokens come back to the API server as text.

One process does both directions, polling two sockets: requests (TokenizeMsg, AbortMsg) from the
API server and DetokenizeMsg batches from the scheduler. Each scheduler step becomes one message
to the API server, so a busy step costs one hop, not one per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl.core import RequestError
from minisgl.message import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, UserMsg
from minisgl.message.frontend import AbortMsg, SchedulerStats, TokenizeMsg, TokenLogprob, UserReply
from minisgl.scheduler.check import RequestLimits, check_request
from minisgl.tokenizer.detokenize import IncrementalDetokenizer
from minisgl.tokenizer.tokenize import TokenizeManager
from minisgl.utils.logger import init_logger
from minisgl.utils.mp import POLL_MS, ZmqPullQueue, ZmqPushQueue
from minisgl.utils.trace import TRACE

logger = init_logger(__name__)


@dataclass
class WorkerAddrs:
    requests: str  # the worker receives TokenizeMsg / AbortMsg here (it binds)
    replies: str  # the API server receives UserReply here
    backend: str  # the scheduler receives requests here
    detokenize: str  # the worker receives the scheduler's DetokenizeMsg here (it binds)


@dataclass
class _Request:
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class TokenizerWorker:
    tokenizer: Any
    limits: RequestLimits
    addrs: WorkerAddrs
    requests: dict[int, _Request] = field(default_factory=dict)
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokenize_manager = TokenizeManager(self.tokenizer)
        self._from_api = ZmqPullQueue(self.addrs.requests)
        self._from_scheduler = ZmqPullQueue(self.addrs.detokenize)
        self._to_api = ZmqPushQueue(self.addrs.replies)
        self._to_scheduler = ZmqPushQueue(self.addrs.backend)
        TRACE.start(None, "tokenizer worker")

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_api.socket, zmq.POLLIN)
        poller.register(self._from_scheduler.socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if self._from_api.socket in ready:
                with TRACE.slice("tokenize"):
                    self._handle_api(self._from_api.drain())
            if self._from_scheduler.socket in ready:
                with TRACE.slice("detokenize"):
                    self._handle_scheduler(self._from_scheduler.drain())

    def close(self) -> None:
        for queue in (self._from_api, self._from_scheduler, self._to_api, self._to_scheduler):
            queue.close()
        TRACE.finish()

    # ---- API server -> scheduler -------------------------------------------------------------
    def _handle_api(self, batches: list[list[Any]]) -> None:
        to_scheduler: list[BaseBackendMsg] = []
        replies: list[UserReply] = []
        for msg in (m for batch in batches for m in batch):
            if isinstance(msg, TokenizeMsg):
                try:
                    ids = self.tokenize_manager.tokenize(msg)
                    # checked here too, so a bad request is answered before anything is queued
                    check_request(ids, msg.sampling_params, self.limits)
                except RequestError as e:
                    replies.append(UserReply(msg.uid, "", True, "error", str(e), e.code))
                    continue
                except Exception as e:  # a request the tokenizer chokes on must not take the worker down
                    logger.exception(f"request {msg.uid}: tokenizing failed")
                    replies.append(
                        UserReply(msg.uid, "", True, "error", f"the prompt could not be tokenized: {e}")
                    )
                    continue
                detokenizer = IncrementalDetokenizer(self.tokenizer, msg.sampling_params.stop)
                self.requests[msg.uid] = _Request(detokenizer, len(ids))
                to_scheduler.append(UserMsg(msg.uid, ids, msg.sampling_params))
                TRACE.point(msg.uid, "tokenize")
            elif isinstance(msg, AbortMsg):
                to_scheduler.append(AbortBackendMsg(msg.uid))
            else:
                logger.warning(f"tokenizer worker: unexpected message {type(msg).__name__} ignored")
        if to_scheduler:
            self._to_scheduler.put(BatchBackendMsg(to_scheduler))
        if replies:
            self._to_api.put(replies)

    # ---- scheduler -> API server -------------------------------------------------------------
    def _handle_scheduler(self, batches: list[list[Any]]) -> None:
        replies: list[Any] = []
        stats: SchedulerStats | None = None
        for msg in (m for batch in batches for m in batch):
            if isinstance(msg, SchedulerStats):
                stats = msg  # only the newest counts
            elif isinstance(msg, DetokenizeMsg):
                reply = self._detokenize(msg)
                if reply is not None:
                    replies.append(reply)
        if stats is not None:
            replies.append(stats)
        if replies:
            self._to_api.put(replies)

    def _detokenize(self, msg: DetokenizeMsg) -> UserReply | None:
        req = self.requests.get(msg.uid)
        if req is None:
            return None  # ended here already (a stop string, or an abort): late messages are dropped
        if msg.prompt_tokens:
            req.cached_tokens = msg.cached_tokens
        step = req.detokenizer.step(msg)
        reply = UserReply(msg.uid, step.text, step.finished, step.finish_reason, msg.error, msg.error_code)
        if msg.next_token >= 0:
            req.completion_tokens += 1
            if msg.logprob is not None and step.output_token is not None:
                reply.logprobs = [self._logprob(msg)]
        if step.abort:
            self._to_scheduler.put(BatchBackendMsg([AbortBackendMsg(msg.uid)]))
        if step.finished:
            del self.requests[msg.uid]
            TRACE.point(msg.uid, "detokenize", step.finish_reason)
        reply.prompt_tokens, reply.cached_tokens = req.prompt_tokens, req.cached_tokens
        reply.completion_tokens = req.completion_tokens
        return reply

    def _logprob(self, msg: DetokenizeMsg) -> TokenLogprob:
        top = [TokenLogprob(int(t), self._text_of(int(t)), float(lp)) for t, lp in msg.top_logprobs or []]
        return TokenLogprob(msg.next_token, self._text_of(msg.next_token), float(msg.logprob or 0.0), top)

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text
