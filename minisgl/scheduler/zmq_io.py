"""ZmqSchedulerIO: the scheduler's receive_msg / send_result in online mode, over ZMQ to the tokenizer worker."""

from __future__ import annotations

from typing import Any

from minisgl.message import BaseBackendMsg
from minisgl.message.tokenizer import pack_step
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.mp import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.process import release_free_memory


class ZmqSchedulerIO:
    def __init__(self, config: SchedulerConfig) -> None:
        self._requests = ZmqPullQueue(config.zmq_backend_addr)
        self._replies = ZmqPushQueue(config.zmq_detokenizer_addr)

    def receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        """What has arrived; with `blocking`, wait for at least one message first."""
        if blocking:
            # nothing to run: what the last burst of work freed goes back to the OS while the scheduler waits
            release_free_memory()
        msgs = [self._requests.get()] if blocking else []
        return msgs + self._requests.drain()

    def send_result(self, reply: list[Any]) -> None:
        # PUSH with no high-water mark: the send queues the bytes for ZMQ's I/O thread and returns, so the
        # loop never waits on the worker; what it costs is the encoding, kept small by pack_step
        self._replies.put(pack_step(reply))

    def close(self) -> None:
        self._requests.close()
        self._replies.close()
