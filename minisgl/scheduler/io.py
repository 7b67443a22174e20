"""SchedulerIOMixin: how the scheduler receives requests and sends results.

Offline (`LLM`) the two methods are overridden in memory; online they go over ZMQ to the
tokenizer/detokenizer worker, and rank 0 forwards what it receives to the other TP ranks.
"""

from __future__ import annotations

from typing import Any

from minisgl.message import BaseBackendMsg, DetokenizeMsg
from minisgl.scheduler.config import SchedulerConfig


class SchedulerIOMixin:
    def __init__(self, config: SchedulerConfig, tp_cpu_group: Any) -> None:
        self.io_config = config
        self.tp_cpu_group = tp_cpu_group
        if config.offline_mode:
            self.receive_msg = self.offline_receive_msg
            self.send_result = self.offline_send_result
        else:
            from minisgl.scheduler.zmq_io import ZmqSchedulerIO

            self._zmq_io = ZmqSchedulerIO(config)
            self.receive_msg = self._zmq_io.receive_msg
            self.send_result = self._zmq_io.send_result

    def offline_receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        raise NotImplementedError("offline mode needs a subclass (LLM) that feeds requests")

    def offline_send_result(self, reply: list[DetokenizeMsg]) -> None:
        raise NotImplementedError("offline mode needs a subclass (LLM) that collects results")

    def close_io(self) -> None:
        if hasattr(self, "_zmq_io"):
            self._zmq_io.close()
