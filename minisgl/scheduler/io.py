"""SchedulerIOMixin: how the scheduler receives requests and sends results.

Online, the two methods go over ZMQ to the tokenizer/detokenizer worker, and every reply carries
the scheduler's load (`stats()`) for /metrics. Offline, `LLM` overrides both in memory.
"""

from __future__ import annotations

from typing import Any

from minisgl.message import BaseBackendMsg, DetokenizeMsg
from minisgl.message.frontend import SchedulerStats
from minisgl.scheduler.config import SchedulerConfig


class SchedulerIOMixin:
    def __init__(self, config: SchedulerConfig, tp_cpu_group: Any) -> None:
        self.tp_cpu_group = tp_cpu_group
        self._zmq_io = None
        if not config.offline_mode:
            from minisgl.scheduler.zmq_io import ZmqSchedulerIO

            self._zmq_io = ZmqSchedulerIO(config)

    def receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        """What has arrived; with `blocking`, wait for at least one message first."""
        assert self._zmq_io is not None, "offline mode needs a subclass (LLM) that feeds requests"
        return self._zmq_io.receive_msg(blocking)

    def send_result(self, reply: list[DetokenizeMsg]) -> None:
        assert self._zmq_io is not None, "offline mode needs a subclass (LLM) that collects results"
        stats: SchedulerStats = self.stats()  # type: ignore[attr-defined]
        self._zmq_io.send_result([*reply, stats])

    def close_io(self) -> None:
        if self._zmq_io is not None:
            self._zmq_io.close()
