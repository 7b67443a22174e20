"""The tokenizer worker: prompts from the API server go to the scheduler as token ids, and the
scheduler's tokens come back to the API server as text.

One process does both directions, polling two sockets: requests (TokenizeMsg, AbortMsg) from the
API server and a message a step from the scheduler. Each scheduler step becomes one message to the
API server, so a busy step costs one hop, not one per request; its tokens are decoded in one call
(`step_batch`), and steps that arrived together leave as one reply a request.

No call may hold up the others: prompts wait in one queue per API call and are tokenized in turns,
one step of one prompt of each call at a time (a long text takes a step a piece: tokenize.Tokenization),
in slices of a few milliseconds between polls of the sockets. A call of a thousand prompts and a call of
one are then served side by side, a megabyte prompt beside a short one, and streams keep flowing
meanwhile. A /tokenize or /detokenize call (TokensMsg) takes its turns the same way, a few of its entries a
step (tokens.TokensJob). An abort of a prompt
still waiting, or part-way through its steps, drops it unread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl.core import RequestError
from minisgl.message import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, UserMsg
from minisgl.message.backend import FlushCacheMsg
from minisgl.message.frontend import (
    AbortMsg,
    SchedulerStats,
    TokenizeMsg,
    TokenLogprob,
    TokensMsg,
    TokensReply,
    UserReply,
    merge_replies,
)
from minisgl.message.tokenizer import FlushCacheReply, unpack_step
from minisgl.scheduler.check import RequestLimits, check_request
from minisgl.tokenizer.detokenize import DetokenizeStep, IncrementalDetokenizer, step_batch
from minisgl.tokenizer.reasoning import ReasoningCount, prompt_opens, reasoning_format, tag_ids
from minisgl.tokenizer.tokenize import Tokenization, TokenizeManager
from minisgl.tokenizer.tokens import TokensJob
from minisgl.utils.logger import init_logger
from minisgl.utils.mp import POLL_MS, ZmqPullQueue, ZmqPushQueue
from minisgl.utils.trace import TRACE

logger = init_logger(__name__)

_SLICE_S = 0.02  # tokenizing runs this long at most (plus one prompt) before the sockets are polled again


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
    # sent with the first reply, then dropped (TokenizeMsg.return_prompt)
    prompt: tuple[list[int], str] | None = None
    reasoning_open: bool | None = None  # sent with the first reply, then dropped (TokenizeMsg.reasoning)
    reasoning_count: ReasoningCount | None = None  # with TokenizeMsg.reasoning, where its tags are tokens
    in_step: bool = False  # a message of the step being gathered is this request's


@dataclass
class TokenizerWorker:
    tokenizer: Any
    limits: RequestLimits
    addrs: WorkerAddrs
    requests: dict[int, _Request] = field(default_factory=dict)
    # prompts not tokenized yet: a queue per API call (a /tokenize call is one too), and the waiting
    # message of each uid
    # (a prompt some steps into its tokenization waits as its Tokenization)
    pending: deque[deque[TokenizeMsg | TokensMsg | TokensJob | Tokenization]] = field(default_factory=deque)
    _pending_uids: dict[int, TokenizeMsg] = field(default_factory=dict)
    _token_text: dict[int, str] = field(default_factory=dict)
    _tag_ids: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # by reasoning format

    def __post_init__(self) -> None:
        self.tokenize_manager = TokenizeManager(self.tokenizer, self.limits)
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
            ready = dict(poller.poll(0 if self.pending else POLL_MS))
            if self._from_api.socket in ready:
                with TRACE.slice("tokenize"):
                    self._handle_api(self._from_api.drain())
            if self._from_scheduler.socket in ready:
                with TRACE.slice("detokenize"):
                    self._handle_scheduler(self._from_scheduler.drain())
            if self.pending:
                self._tokenize_pending()

    def close(self) -> None:
        for queue in (self._from_api, self._from_scheduler, self._to_api, self._to_scheduler):
            queue.close()
        TRACE.finish()

    # ---- API server -> scheduler -------------------------------------------------------------
    def _handle_api(self, batches: list[list[Any]]) -> None:
        to_scheduler: list[BaseBackendMsg] = []
        replies: list[UserReply | TokensReply] = []
        for batch in batches:  # one API call's messages
            call: deque[TokenizeMsg | TokensMsg | TokensJob | Tokenization] = deque()
            for msg in batch:
                if isinstance(msg, TokensMsg):
                    call.append(msg)
                elif isinstance(msg, TokenizeMsg):
                    call.append(msg)
                    self._pending_uids.update(dict.fromkeys(msg.uids, msg))
                elif isinstance(msg, FlushCacheMsg):
                    to_scheduler.append(msg)  # the scheduler answers it
                elif isinstance(msg, AbortMsg):
                    waiting = self._pending_uids.pop(msg.uid, None)
                    if waiting is None:
                        to_scheduler.append(AbortBackendMsg(msg.uid))
                        continue
                    i = waiting.uids.index(msg.uid)
                    del waiting.uids[i], waiting.sampling_params[i]
                    replies.append(UserReply(msg.uid, "", True, "abort"))
                else:
                    logger.warning(f"tokenizer worker: unexpected message {type(msg).__name__} ignored")
            if call:
                self.pending.append(call)
        self._send(to_scheduler, replies)

    def _tokenize_pending(self) -> None:
        """Tokenize waiting prompts for one slice of time, one step of one prompt of each call in turn (a
        long prompt takes several steps, its call's turn each, and keeps its place at the call's head)."""
        to_scheduler: list[BaseBackendMsg] = []
        replies: list[UserReply | TokensReply] = []
        end = time.monotonic() + _SLICE_S
        while self.pending:  # at least one step a slice
            call = self.pending.popleft()
            item = call.popleft()
            if isinstance(item, (TokensMsg, TokensJob)):
                tokens = item if isinstance(item, TokensJob) else TokensJob(self.tokenize_manager, item)
                reply = tokens.step()
                if reply is None:
                    call.appendleft(tokens)  # more entries to go: its call's next turn
                else:
                    replies.append(reply)
            else:
                job = item if isinstance(item, Tokenization) else Tokenization(self.tokenize_manager, item)
                if job.msg.uids:  # not every choice aborted
                    done, ids = self._step(job, replies)
                    if not done:
                        call.appendleft(job)  # more steps to go
                    else:
                        for uid in job.msg.uids:
                            del self._pending_uids[uid]
                        if ids is not None:
                            to_scheduler += self._requests_of(job, ids, replies)
            if call:
                self.pending.append(call)
            if time.monotonic() >= end:
                break
        self._send(to_scheduler, replies)

    def _send(self, to_scheduler: list[BaseBackendMsg], replies: list[UserReply | TokensReply]) -> None:
        if to_scheduler:
            self._to_scheduler.put(BatchBackendMsg(to_scheduler))
        if replies:
            self._to_api.put(replies)

    def _step(
        self, job: Tokenization, replies: list[UserReply | TokensReply]
    ) -> tuple[bool, list[int] | None]:
        """One step of a prompt's tokenization: (done, its ids once done); on an error (done, None), with
        every choice's error reply."""
        msg = job.msg
        try:
            ids = job.step()
            return ids is not None, ids
        except RequestError as e:
            replies += [UserReply(uid, "", True, "error", str(e), e.code) for uid in msg.uids]
        except Exception as e:  # a request the tokenizer chokes on must not take the worker down
            logger.exception(f"requests {msg.uids}: tokenizing failed")
            error = f"the prompt could not be tokenized: {e}"
            replies += [UserReply(uid, "", True, "error", error) for uid in msg.uids]
        return True, None

    def _requests_of(
        self, job: Tokenization, ids: list[int], replies: list[UserReply | TokensReply]
    ) -> list[BaseBackendMsg]:
        """The scheduler's requests for a prompt's choices; the prompt was tokenized once for all of them."""
        msg = job.msg
        out: list[BaseBackendMsg] = []
        reasoning_open = tags = None
        if msg.reasoning is not None:
            fmt = reasoning_format(msg.reasoning)
            reasoning_open = prompt_opens(fmt, job.turn_opening or "")
            if fmt.name not in self._tag_ids:
                self._tag_ids[fmt.name] = tag_ids(self.tokenizer, fmt)
            tags = self._tag_ids[fmt.name]
        for uid, params in zip(msg.uids, msg.sampling_params):
            try:
                # checked here too, so a bad request is answered before anything is queued
                check_request(ids, params, self.limits)
            except RequestError as e:
                replies.append(UserReply(uid, "", True, "error", str(e), e.code))
                continue
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                params.stop,
                min_tokens=params.min_tokens,
                skip_special_tokens=params.skip_special_tokens,
                keep_stop=params.include_stop_str_in_output,
            )
            self.requests[uid] = _Request(detokenizer, len(ids))
            if msg.return_prompt:
                kept = msg.text is not None and not job.truncated
                text = msg.text if kept else self.tokenizer.decode(ids)
                self.requests[uid].prompt = (ids, text)
            # a grammar holds the output from its first token: it starts as the answer (reasoning.py)
            opened = reasoning_open and params.grammar is None
            self.requests[uid].reasoning_open = opened
            if tags is not None:
                self.requests[uid].reasoning_count = ReasoningCount(tags, bool(opened))
            out.append(UserMsg(uid, ids, params, msg.priority, msg.cache_salt))
            TRACE.point(uid, "tokenize")
        return out

    # ---- scheduler -> API server -------------------------------------------------------------
    def _handle_scheduler(self, batches: list[list[Any]]) -> None:
        replies: list[Any] = []
        stats: SchedulerStats | None = None
        step: list[tuple[_Request, DetokenizeMsg]] = []
        behind = False
        for msg in (m for batch in batches for m in unpack_step(batch)):
            if isinstance(msg, SchedulerStats):
                stats = msg  # only the newest counts
            elif isinstance(msg, FlushCacheReply):
                replies.append(msg)
            elif isinstance(msg, DetokenizeMsg):
                req = self.requests.get(msg.uid)
                if req is not None and req.in_step:
                    # a second step of this request arrived in the same drain: finish the first step first
                    replies += self._detokenize(step)
                    step, behind = [], True
                    req = self.requests.get(msg.uid)
                if req is None:
                    continue  # ended here already (a stop string, or an abort): late messages are dropped
                req.in_step = True
                step.append((req, msg))
        replies += self._detokenize(step)
        if behind:
            # several steps came at once: the API server gets one reply a request, not one a token
            merged: dict[int, UserReply] = {}
            for r in replies:
                merged[r.uid] = merge_replies(merged[r.uid], r) if r.uid in merged else r
            replies = list(merged.values())
        if stats is not None:
            replies.append(stats)
        if replies:
            self._to_api.put(replies)

    def _detokenize(self, step: list[tuple[_Request, DetokenizeMsg]]) -> list[UserReply]:
        """The replies to one step's messages, at most one a request, decoded together."""
        results = step_batch(self.tokenizer, [(req.detokenizer, msg) for req, msg in step])
        aborts: list[BaseBackendMsg] = []
        replies = []
        for (req, msg), result in zip(step, results):
            req.in_step = False
            replies.append(self._reply(req, msg, result))
            if result.abort:
                aborts.append(AbortBackendMsg(msg.uid))
        if aborts:
            self._to_scheduler.put(BatchBackendMsg(aborts))
        return replies

    def _reply(self, req: _Request, msg: DetokenizeMsg, step: DetokenizeStep) -> UserReply:
        if msg.prompt_tokens:
            req.cached_tokens = msg.cached_tokens
        reply = UserReply(msg.uid, step.text, step.finished, step.finish_reason, msg.error, msg.error_code)
        if msg.next_token >= 0:
            req.completion_tokens += 1
            # a stop token is counted and reported like any other token, though it is not in the text
            reply.token_ids = [msg.next_token]
            if msg.logprob is not None:
                reply.logprobs = [self._logprob(msg)]
        if step.finish_reason == "stop":
            reply.matched_stop = req.detokenizer.matched if req.detokenizer.stopped else msg.next_token
            reply.matched_eos = msg.matched_eos and not req.detokenizer.stopped
        count = req.reasoning_count
        if count is not None:
            # the stop token that ends the output is not in its text, nor in its reasoning
            if msg.next_token >= 0 and not (
                step.finish_reason == "stop" and reply.matched_stop == msg.next_token
            ):
                count.add(msg.next_token)
            reply.reasoning_tokens = count.tokens
        if req.prompt is not None:
            reply.prompt_token_ids, reply.prompt_text = req.prompt
            req.prompt = None
        if req.reasoning_open is not None:
            reply.reasoning_open, req.reasoning_open = req.reasoning_open, None
        if msg.prompt_logprobs is not None:
            reply.prompt_logprobs = [
                TokenLogprob(
                    int(t),
                    self._text_of(int(t)),
                    None if lp is None else float(lp),
                    [self._top(x) for x in top],
                    None if rank is None else int(rank),
                )
                for t, lp, rank, top in msg.prompt_logprobs
            ]
        if step.finished:
            del self.requests[msg.uid]
            TRACE.point(msg.uid, "detokenize", step.finish_reason)
        reply.prompt_tokens, reply.cached_tokens = req.prompt_tokens, req.cached_tokens
        reply.completion_tokens = req.completion_tokens
        return reply

    def _top(self, entry: Any) -> TokenLogprob:
        token, logprob = entry
        return TokenLogprob(int(token), self._text_of(int(token)), float(logprob))

    def _logprob(self, msg: DetokenizeMsg) -> TokenLogprob:
        top = [self._top(x) for x in msg.top_logprobs or []]
        return TokenLogprob(msg.next_token, self._text_of(msg.next_token), float(msg.logprob or 0.0), top)

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text
