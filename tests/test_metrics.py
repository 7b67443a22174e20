"""The API server's counters that /metrics renders, apart from a server."""

from __future__ import annotations

import pytest

from minisgl.server.metrics import Metrics


def test_gen_throughput_counts_the_last_ten_seconds_only() -> None:
    m = Metrics()
    m.generated(100.0, 500)  # leaves the window before the last reading
    for i in range(40):  # 20 tokens every 0.25 s from t=101: 800 tokens over 10 s
        m.generated(101.0 + 0.25 * i, 20)
    assert m.generation_tokens == 1300
    assert m.gen_throughput(110.9) == pytest.approx(80.0)
    # at 115.0 the window starts at the 0.1 s stretch of 105.1: the 23 bursts from t=105.25 on are left
    assert m.gen_throughput(115.0) == pytest.approx(23 * 20 / 10)
    assert m.gen_throughput(200.0) == 0.0
    assert len(m._recent) <= 100  # a stretch of 0.1 s each, not an entry a reply
