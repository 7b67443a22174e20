"""SchedulerIOMixin: how the scheduler receives requests and sends results.

Online, the two methods go over ZMQ to the tokenizer/detokenizer worker, and every reply carries
the scheduler's load (`stats()`) for /metrics. Offline, `LLM` overrides both in memory.

With tensor parallelism only rank 0 talks to the outside: it forwards every message it receives
to the other ranks (`receive_all`), so each rank's scheduler sees the same messages at the same
step and builds the same batches; only rank 0 replies (`reply`).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import torch

from minisgl.distributed import DistributedInfo
from minisgl.message import BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, ExitMsg, UserMsg
from minisgl.message.frontend import SchedulerStats
from minisgl.message.tokenizer import FlushCacheReply, TokenStepMsg
from minisgl.scheduler.config import SchedulerConfig


class SchedulerIOMixin:
    def __init__(self, config: SchedulerConfig, tp_cpu_group: Any) -> None:
        self.tp_info: DistributedInfo = config.tp_info
        self.tp_cpu_group = tp_cpu_group
        self._zmq_io = None
        if not config.offline_mode and self.tp_info.rank == 0:
            from minisgl.scheduler.zmq_io import ZmqSchedulerIO

            self._zmq_io = ZmqSchedulerIO(config)

    def receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        """What has arrived; with `blocking`, wait for at least one message first."""
        assert self._zmq_io is not None, "offline mode needs a subclass (LLM) that feeds requests"
        return self._zmq_io.receive_msg(blocking)

    def send_result(self, reply: list[DetokenizeMsg | TokenStepMsg | FlushCacheReply]) -> None:
        assert self._zmq_io is not None, "offline mode needs a subclass (LLM) that collects results"
        stats: SchedulerStats = self.stats()  # type: ignore[attr-defined]
        self._zmq_io.send_result([*reply, stats])

    def receive_all(self, blocking: bool) -> list[BaseBackendMsg]:
        """receive_msg on rank 0, forwarded to every rank (the others wait here for rank 0)."""
        if self.tp_info.size == 1:
            return self.receive_msg(blocking)
        msgs: list[BaseBackendMsg] = []
        if self.tp_info.rank == 0:
            # a request without a seed gets one here, so that every rank samples with the same
            msgs = [_with_seed(m) for m in self.receive_msg(blocking)]
        return self._broadcast_msgs(msgs)

    def _broadcast_msgs(self, msgs: list[BaseBackendMsg]) -> list[BaseBackendMsg]:
        """Rank 0's messages on every rank: their pickled length, then the bytes only when there are any.

        Most steps have no message: one 8-byte broadcast then, where broadcast_object_list always
        pickles and sends twice (about 4x the time over gloo).
        """
        import torch.distributed as dist

        root = self.tp_info.rank == 0
        payload = pickle.dumps(msgs) if root and msgs else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.tp_cpu_group)
        n = int(size.item())
        if n == 0:
            return msgs
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if root
            else torch.empty(n, dtype=torch.uint8)
        )
        dist.broadcast(data, src=0, group=self.tp_cpu_group)
        return msgs if root else pickle.loads(data.numpy().tobytes())

    def reply(self, reply: list[DetokenizeMsg | TokenStepMsg | FlushCacheReply]) -> None:
        if self.tp_info.rank == 0:
            self.send_result(reply)

    def close_io(self) -> None:
        if self._zmq_io is not None:
            self._zmq_io.close()
        if self.tp_info.size > 1 and self.tp_info.rank == 0:
            try:
                self._broadcast_msgs([ExitMsg()])
            except Exception:  # a rank already gone: its owner kills the rest
                pass


def _with_seed(msg: BaseBackendMsg) -> BaseBackendMsg:
    if isinstance(msg, BatchBackendMsg):
        return BatchBackendMsg([_with_seed(m) for m in msg.data])
    if isinstance(msg, UserMsg) and msg.sampling_params.seed is None:
        return replace(
            msg, sampling_params=replace(msg.sampling_params, seed=msg.sampling_params.resolved_seed())
        )
    return msg
