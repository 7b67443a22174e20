"""EngineClient: how the API server and the shell talk to the tokenizer worker.

A call submits a RequestGroup (one sub-request per prompt and choice); the replies of all its
sub-requests arrive on the group's queue. Closing a group aborts whatever has not finished, so a
client that goes away frees its slots and pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from minisgl.message.frontend import AbortMsg, SchedulerStats, TokenizeMsg, UserReply
from minisgl.server.metrics import Metrics
from minisgl.utils.logger import init_logger
from minisgl.utils.mp import ZmqAsyncPullQueue, ZmqPushQueue

logger = init_logger(__name__)


@dataclass
class ServeInfo:
    """What the front end knows of the model being served."""

    model_name: str
    model_path: str | None  # as given on the command line; clients may name the model by it too
    max_seq_len: int
    stats: SchedulerStats = field(default_factory=SchedulerStats)  # the scheduler's load once ready


class EngineUnavailable(RuntimeError):
    """The worker processes are gone (a crash or a shutdown): no request can be served."""


class RequestGroup:
    def __init__(self, client: EngineClient, uids: list[int]) -> None:
        self.client = client
        self.uids = uids
        self.index = {uid: i for i, uid in enumerate(uids)}
        self.queue: asyncio.Queue[tuple[int, UserReply]] = asyncio.Queue()
        self.unfinished = set(uids)
        self.started: set[int] = set()  # sub-requests that have produced a token
        self.arrival = time.perf_counter()
        self.closed = False

    async def get(self) -> tuple[int, UserReply]:
        """The next reply of any sub-request, with the sub-request's index."""
        return await self.queue.get()

    def close(self) -> None:
        """The call is over: abort every sub-request that has not finished. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.client.abort([uid for uid in self.uids if uid in self.unfinished])


class EngineClient:
    def __init__(self, requests_addr: str, replies_addr: str, stats: SchedulerStats | None = None) -> None:
        self._to_worker = ZmqPushQueue(requests_addr)
        self._from_worker = ZmqAsyncPullQueue(replies_addr)
        self._groups: dict[int, RequestGroup] = {}  # by uid, until that sub-request finishes
        self._next_uid = 0
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None
        self.metrics = Metrics()
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

    def submit(self, msgs: list[TokenizeMsg]) -> RequestGroup:
        """Send the prompts (their choices' uids are assigned here) and return the group their replies go to."""
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        for msg in msgs:
            msg.uids = list(range(self._next_uid, self._next_uid + len(msg.sampling_params)))
            self._next_uid += len(msg.uids)
        # registered only once the worker has them: a message that cannot be sent leaves nothing behind
        self._to_worker.put(msgs)
        group = RequestGroup(self, [uid for msg in msgs for uid in msg.uids])
        for uid in group.uids:
            self._groups[uid] = group
        self.metrics.in_flight += len(group.uids)
        return group

    def abort(self, uids: list[int]) -> None:
        # the group stays registered: the abort reply still ends each sub-request and is counted
        if uids and self.failure is None:
            self._to_worker.put([AbortMsg(uid) for uid in uids])

    def fail_all(self, reason: str) -> None:
        """End every open request with an error: the workers are gone and no reply will come."""
        self.failure = reason
        for uid in list(self._groups):
            self._dispatch(UserReply(uid, "", True, "error", reason, "engine_unavailable"))

    async def _receive_loop(self) -> None:
        while True:
            for msg in await self._from_worker.get():
                if isinstance(msg, SchedulerStats):
                    self.metrics.scheduler = msg
                else:
                    self._dispatch(msg)

    def _dispatch(self, reply: UserReply) -> None:
        group = self._groups.get(reply.uid)
        if group is None:
            return
        now = time.perf_counter()
        m = self.metrics
        if reply.uid not in group.started and reply.completion_tokens > 0:
            group.started.add(reply.uid)
            m.ttft.observe(now - group.arrival)
            m.prompt_tokens += reply.prompt_tokens
            m.cached_tokens += reply.cached_tokens
        if reply.finished:
            del self._groups[reply.uid]
            group.unfinished.discard(reply.uid)
            m.in_flight -= 1
            m.generation_tokens += reply.completion_tokens
            m.finished[reply.finish_reason or "error"] += 1
            if reply.finish_reason in ("stop", "length"):
                m.e2e.observe(now - group.arrival)
        group.queue.put_nowait((group.index[reply.uid], reply))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.fail_all("the server is shutting down")
        self._to_worker.close()
        self._from_worker.close()
