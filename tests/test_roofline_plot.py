"""roofline_plot.py: each decode step against the larger of its two floors, drawn by batch size."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "offline"))

from roofline_plot import decode_rows, plot  # noqa: E402

RESULT = {
    "device": "a GPU",
    "ceilings": {"copy_tb_s": 4.2, "matmul_tflops": 780.0},
    "steps": {
        "decode_bs256": {"graph_step_ms": 7.26, "bandwidth_floor_ms": 6.04, "flop_floor_ms": 0.4},
        "decode_bs1": {"graph_step_ms": 0.9, "bandwidth_floor_ms": 0.3, "flop_floor_ms": 0.001},
        "decode_bs64": {"graph_step_ms": 2.95, "bandwidth_floor_ms": 1.69, "flop_floor_ms": 2.0},
        "prefill_8x1024": {"ms": 29.3},
    },
}


def test_rows_are_sorted_by_batch_size_and_take_the_larger_floor() -> None:
    assert decode_rows(RESULT) == [(1, 0.9, 0.3), (64, 2.95, 2.0), (256, 7.26, 6.04)]


def test_a_result_without_decode_steps_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="steps section"):
        plot({"steps": {"prefill_8x1024": {"ms": 1.0}}}, str(tmp_path / "x.png"))


def test_the_plot_is_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "roofline.png"
    assert plot(RESULT, str(path)) == decode_rows(RESULT)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
