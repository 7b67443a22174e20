"""The tokenizer worker's output side: a scheduler step's tokens become one reply a request; steps that
arrive together are decoded step by step and leave as one reply a request; a stop string found in the
text ends the request and tells the scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tiny import build_tokenizer

from minisgl.core import SamplingParams
from minisgl.message import AbortBackendMsg, BatchBackendMsg, DetokenizeMsg, UserMsg
from minisgl.message.frontend import SchedulerStats, TokenizeMsg, UserReply
from minisgl.scheduler.check import RequestLimits
from minisgl.utils.mp import ZmqPullQueue, ipc_addr


@pytest.fixture
def worker(tmp_path: Any) -> Iterator[tuple[Any, ZmqPullQueue, ZmqPullQueue]]:
    """A worker on the tiny tokenizer, with queues standing in for the scheduler and the API server."""
    from minisgl.tokenizer.worker import TokenizerWorker, WorkerAddrs

    addrs = WorkerAddrs(*(ipc_addr(str(tmp_path), n) for n in ("requests", "replies", "backend", "detok")))
    to_scheduler, to_api = ZmqPullQueue(addrs.backend), ZmqPullQueue(addrs.replies)
    tokenizer = build_tokenizer(str(tmp_path / "tokenizer"))
    w = TokenizerWorker(tokenizer, RequestLimits(512, len(tokenizer), 100_000, 1), addrs)
    yield w, to_scheduler, to_api
    w.close()
    to_scheduler.close()
    to_api.close()


def _received(queue: ZmqPullQueue) -> list[list[Any]]:
    """Each message that arrived, as the list of items it carried."""
    assert queue.socket.poll(5000)
    return [b.data if isinstance(b, BatchBackendMsg) else b for b in queue.drain()]


def _start(w: Any, to_scheduler: ZmqPullQueue, prompts: dict[int, tuple[str, list[str] | None]]) -> None:
    msgs = [
        TokenizeMsg([SamplingParams(max_tokens=100, stop=stop)], text=p, uids=[u])
        for u, (p, stop) in prompts.items()
    ]
    w._handle_api([msgs])
    while w.pending:
        w._tokenize_pending()
    assert all(isinstance(m, UserMsg) for batch in _received(to_scheduler) for m in batch)


def test_one_step_of_many_requests_is_one_message_with_a_reply_each(worker: Any) -> None:
    w, to_scheduler, to_api = worker
    _start(w, to_scheduler, {u: ("hello", None) for u in range(5)})
    ids = w.tokenizer.encode(" one two")
    w._handle_scheduler(
        [[DetokenizeMsg(u, ids[0], False, prompt_tokens=2) for u in range(5)] + [SchedulerStats(running=5)]]
    )
    (message,) = _received(to_api)
    replies = [r for r in message if isinstance(r, UserReply)]
    assert [r.uid for r in replies] == list(range(5)) and isinstance(message[-1], SchedulerStats)
    assert all(r.completion_tokens == 1 and r.token_ids == [ids[0]] for r in replies)


def test_steps_that_arrive_together_become_one_reply_a_request(worker: Any) -> None:
    w, to_scheduler, to_api = worker
    _start(w, to_scheduler, {0: ("a", None), 1: ("b", ["two"])})
    ids = w.tokenizer.encode(" one two three four")
    steps = [[DetokenizeMsg(0, t, False), DetokenizeMsg(1, t, False)] for t in ids]
    steps.append([DetokenizeMsg(0, ids[0], True, "length")])
    w._handle_scheduler(steps)  # the worker was busy: every step is waiting at once
    (message,) = _received(to_api)
    by_uid = {r.uid: r for r in message}
    assert set(by_uid) == {0, 1} and len(message) == 2
    assert by_uid[0].text == w.tokenizer.decode([*ids, ids[0]], skip_special_tokens=True)
    assert by_uid[0].token_ids == [*ids, ids[0]] and by_uid[0].completion_tokens == len(ids) + 1
    assert by_uid[0].finish_reason == "length"
    # the stop string ended request 1 in the text: cut there, later tokens dropped, the scheduler told
    assert by_uid[1].text == " one " and by_uid[1].finish_reason == "stop" and by_uid[1].matched_stop == "two"
    aborts = [m for batch in _received(to_scheduler) for m in batch]
    assert aborts == [AbortBackendMsg(1)]
    assert w.requests == {}
