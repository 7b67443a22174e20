"""EngineClient: how the API server and the shell talk to the tokenizer worker.

A call submits a RequestGroup (one sub-request per prompt and choice); the replies of all its
sub-requests arrive on the group (`get`, or `get_all` for all that wait). Closing a group aborts
whatever has not finished, so a client that goes away frees its slots and pages. The client sees every reply, so it is where each
finished sub-request gets its log line (token counts, time to first token, total time, finish reason).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from minisgl.message.backend import FlushCacheMsg
from minisgl.message.frontend import AbortMsg, SchedulerStats, TokenizeMsg, TokensMsg, TokensReply, UserReply
from minisgl.message.tokenizer import FlushCacheReply
from minisgl.server.metrics import Metrics
from minisgl.tokenizer.reasoning import ReasoningFormat
from minisgl.tokenizer.tool_parser import ToolSupport
from minisgl.utils.logger import init_logger
from minisgl.utils.mp import ZmqAsyncPullQueue, ZmqPushQueue
from minisgl.utils.trace import TRACE

logger = init_logger(__name__)


@dataclass
class ServeInfo:
    """What the front end knows of the model being served."""

    model_name: str  # the name /v1/models reports first
    model_path: str | None  # as given on the command line; clients may name the model by it too
    max_seq_len: int
    other_names: list[str] = field(default_factory=list)  # --served-model-name's names after the first
    stats: SchedulerStats = field(default_factory=SchedulerStats)  # the scheduler's load once ready
    tools: ToolSupport = field(default_factory=ToolSupport)  # how the model takes tools
    reasoning: ReasoningFormat | None = None  # how a chat's reasoning is split from its answer (None: not)
    priority_scheduling: bool = False  # whether requests may carry a priority (SchedulerConfig)
    server_args: dict[str, Any] = field(default_factory=dict)  # the command line's options, less the API key

    @property
    def served_names(self) -> list[str]:
        return [self.model_name, *self.other_names]

    def accepts(self, name: str) -> bool:
        """Whether a request naming `name` as its model is for this server."""
        return name in self.served_names or name == self.model_path


class EngineUnavailable(RuntimeError):
    """The worker processes are gone (a crash or a shutdown): no request can be served."""


class RequestGroup:
    def __init__(self, client: EngineClient, uids: list[int], request_id: str | None = None) -> None:
        self.client = client
        self.uids = uids
        self.index = {uid: i for i, uid in enumerate(uids)}
        self.request_id = request_id
        # the replies not taken yet, and the future the group's one reader waits on while there are none
        # (an asyncio.Queue costs a future and its bookkeeping per reply; this, one per wait)
        self._replies: deque[tuple[int, UserReply]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.unfinished = set(uids)
        self.first_token_at: dict[int, float] = {}  # sub-requests that have produced a token, and when
        self.last_token_at: dict[int, float] = {}
        self.tokens_seen: dict[int, int] = {}  # output tokens each sub-request has had so far
        self.arrival = time.perf_counter()
        self.closed = False
        self.prompts: dict[int, str] = {}  # the prompt and output text, kept only to be logged
        self.texts: dict[int, str] = {}

    def name(self, uid: int) -> str:
        """The sub-request's name in the log: the call's id (with the choice's index when there are several)."""
        if self.request_id is None:
            return str(uid)
        return self.request_id if len(self.uids) == 1 else f"{self.request_id}/{self.index[uid]}"

    def put(self, index: int, reply: UserReply) -> None:
        """A reply of the sub-request `index` has arrived."""
        self._replies.append((index, reply))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> tuple[int, UserReply]:
        """The next reply of any sub-request, with the sub-request's index."""
        await self._wait()
        return self._replies.popleft()

    async def get_all(self) -> list[tuple[int, UserReply]]:
        """Every reply waiting (at least one: the next is waited for), in order of arrival."""
        await self._wait()
        out = list(self._replies)
        self._replies.clear()
        return out

    async def _wait(self) -> None:
        while not self._replies:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """The call is over: abort every sub-request that has not finished. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.client.abort([uid for uid in self.uids if uid in self.unfinished])


class EngineClient:
    """`log_requests`: an INFO line for every finished sub-request; `log_text`: with its prompt and output."""

    def __init__(
        self,
        requests_addr: str,
        replies_addr: str,
        stats: SchedulerStats | None = None,
        log_requests: bool = False,
        log_text: bool = False,
        model_name: str = "",
    ) -> None:
        self.log_requests = log_requests
        self.log_text = log_requests and log_text
        self._to_worker = ZmqPushQueue(requests_addr)
        self._from_worker = ZmqAsyncPullQueue(replies_addr)
        self._groups: dict[int, RequestGroup] = {}  # by uid, until that sub-request finishes
        self._next_uid = 0
        # /tokenize, /detokenize and /flush_cache calls waiting for their reply
        self._lookups: dict[int, asyncio.Future[Any]] = {}
        self._next_lookup = 0
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None
        self.metrics = Metrics(model_name)
        if stats is not None:  # until the scheduler's first report arrives
            self.metrics.scheduler = stats

    def start(self) -> None:
        """Start receiving replies; call from inside the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())
        self._task.add_done_callback(self._receiver_done)

    def _receiver_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # without the receiver every open request would wait forever
            logger.error("the reply receiver failed", exc_info=task.exception())
            self.fail_all(f"the server's reply receiver failed: {task.exception()}")

    def submit(self, msgs: list[TokenizeMsg], request_id: str | None = None) -> RequestGroup:
        """Send the prompts (their choices' uids are assigned here) and return the group their replies go to.

        `request_id` names the call in the log (None: each sub-request's uid)."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        for msg in msgs:
            msg.uids = list(range(self._next_uid, self._next_uid + len(msg.sampling_params)))
            self._next_uid += len(msg.uids)
        # the arrival comes first in the trace: the worker may tokenize before this call returns
        TRACE.arrivals([uid for msg in msgs for uid in msg.uids])
        # registered only once the worker has them: a message that cannot be sent leaves nothing behind
        self._to_worker.put(msgs)
        group = RequestGroup(self, [uid for msg in msgs for uid in msg.uids], request_id)
        if self.log_text:
            for msg in msgs:
                for uid in msg.uids:
                    group.prompts[uid] = _prompt_text(msg)
        for uid in group.uids:
            self._groups[uid] = group
        self.metrics.in_flight += len(group.uids)
        return group

    async def tokens(self, msg: TokensMsg) -> TokensReply:
        """Ask the worker to tokenize or detokenize and wait for its answer."""
        return await self._ask(msg)

    async def flush_cache(self) -> FlushCacheReply:
        """Ask the scheduler to empty the prefix cache (through the worker) and wait for its answer."""
        return await self._ask(FlushCacheMsg(0))

    async def _ask(self, msg: Any) -> Any:
        """Send a message answered by one reply of its uid (assigned here), and wait for that reply."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        msg.uid, self._next_lookup = self._next_lookup, self._next_lookup + 1
        future = asyncio.get_running_loop().create_future()
        self._lookups[msg.uid] = future
        try:
            self._to_worker.put([msg])
            return await future
        finally:
            del self._lookups[msg.uid]

    def abort(self, uids: list[int]) -> None:
        # the group stays registered: the abort reply still ends each sub-request and is counted
        if uids and self.failure is None:
            self._to_worker.put([AbortMsg(uid) for uid in uids])

    def fail_all(self, reason: str) -> None:
        """End every open request with an error: the workers are gone and no reply will come."""
        self.failure = reason
        for future in self._lookups.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        for uid in list(self._groups):
            self._dispatch(UserReply(uid, "", True, "error", reason, "engine_unavailable"))

    async def _receive_loop(self) -> None:
        while True:
            for msg in await self._from_worker.get():
                if isinstance(msg, SchedulerStats):
                    self.metrics.scheduler = msg
                elif isinstance(msg, (TokensReply, FlushCacheReply)):
                    future = self._lookups.get(msg.uid)
                    if future is not None and not future.done():
                        future.set_result(msg)
                else:
                    self._dispatch(msg)

    def _dispatch(self, reply: UserReply) -> None:
        group = self._groups.get(reply.uid)
        if group is None:
            return
        now = time.perf_counter()
        m = self.metrics
        new_tokens = reply.completion_tokens - group.tokens_seen.get(reply.uid, 0)
        if new_tokens > 0:
            if reply.uid not in group.first_token_at:
                group.first_token_at[reply.uid] = now
                TRACE.point(reply.uid, "first reply")
                m.ttft.observe(now - group.arrival)
                m.prompt_tokens += reply.prompt_tokens
                m.cached_tokens += reply.cached_tokens
                # the first token's wait is the time to first token; each later one waited this long
                if new_tokens > 1:
                    m.itl.observe(0.0, new_tokens - 1)
            else:
                m.itl.observe((now - group.last_token_at[reply.uid]) / new_tokens, new_tokens)
            group.tokens_seen[reply.uid] = reply.completion_tokens
            group.last_token_at[reply.uid] = now
            m.generated(now, new_tokens)
        if reply.finished:
            del self._groups[reply.uid]
            TRACE.point(reply.uid, "reply", reply.finish_reason)
            group.unfinished.discard(reply.uid)
            m.in_flight -= 1
            m.finished[reply.finish_reason or "error"] += 1
            if reply.finish_reason in ("stop", "length"):
                m.e2e.observe(now - group.arrival)
        if self.log_text:
            group.texts[reply.uid] = group.texts.get(reply.uid, "") + reply.text
        if reply.finished and self.log_requests:
            self._log_finished(group, reply, now)
        group.put(group.index[reply.uid], reply)

    def _log_finished(self, group: RequestGroup, reply: UserReply, now: float) -> None:
        first = group.first_token_at.get(reply.uid)
        ttft = f"{first - group.arrival:.3f} s" if first is not None else "-"
        line = (
            f"request {group.name(reply.uid)}: {reply.prompt_tokens} prompt tokens "
            f"({reply.cached_tokens} cached), {reply.completion_tokens} output tokens, "
            f"first token {ttft}, total {now - group.arrival:.3f} s, finish_reason={reply.finish_reason}"
        )
        if reply.error:
            line += f", error: {reply.error}"
        if self.log_text:
            line += (
                f", prompt: {group.prompts.get(reply.uid, '')}, output: {group.texts.get(reply.uid, '')!r}"
            )
        logger.info(line)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.fail_all("the server is shutting down")
        self._to_worker.close()
        self._from_worker.close()


def _prompt_text(msg: TokenizeMsg) -> str:
    if msg.messages is not None:
        return json.dumps(msg.messages, ensure_ascii=False)
    if msg.text is not None:
        return repr(msg.text)
    return str(msg.input_ids)
