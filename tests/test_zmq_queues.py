"""The ZMQ queues between the server's processes (minisgl/utils/mp.py).

A worker's PUSH socket connects before the API server binds its reply queue (the workers start first), so its
first connect fails and ZMQ retries on a timer. At ZMQ's default of 100 ms, the first request sent the moment the
server was ready had its first replies held until that retry (its TTFT 108-129 ms against 37-46 for the next).
"""

from __future__ import annotations

import time
from typing import Any

from minisgl.utils.mp import RECONNECT_MS, ZmqPullQueue, ZmqPushQueue, ipc_addr


def test_a_message_sent_before_its_queue_binds_arrives_soon_after(tmp_path: Any) -> None:
    addr = ipc_addr(str(tmp_path), "replies")
    push = ZmqPushQueue(addr)  # its first connect finds nothing bound
    push.put(["first"])
    time.sleep(0.02)
    pull = ZmqPullQueue(addr)
    bound = time.perf_counter()
    try:
        assert pull.socket.poll(1000), "the message never arrived"
        waited_ms = (time.perf_counter() - bound) * 1e3
        assert pull.get() == ["first"]
    finally:
        push.close()
        pull.close()
    # the retry comes RECONNECT_MS after the failed connect; ZMQ's default (100 ms) would have waited ~80 ms here
    assert RECONNECT_MS <= 10
    assert waited_ms < 50, f"the message waited {waited_ms:.1f} ms after the bind"
