"""workload_model.py: the workload's decode time walked step by step from per-batch rates."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "offline"))

from workload_model import fixed_costs, host_costs, predict  # noqa: E402


def test_each_step_reads_the_running_requests_contexts_at_its_batchs_rate() -> None:
    # two requests: prompts of 10 and 20 tokens, 3 and 1 new tokens; a byte a token
    lens, outs = np.array([10, 20]), np.array([3, 1])
    rate = ([1, 2], [1.0, 2.0])  # bytes/s at one and two rows
    fixed = ([1, 2], [100.0, 200.0])
    attn, rest, total, bound = predict(lens, outs, rate, fixed, kv_bytes_per_token=1, prefill_s=5.0)
    # step 0: both run, (10 + 20) / 2; step 1: the first alone, 11 / 1; step 2: 12 / 1
    assert attn == 15.0 + 11.0 + 12.0
    assert rest == 200.0 + 100.0 + 100.0
    assert total == bound == attn + rest + 5.0  # no host given: the device's steps alone
    # a host that needs 150 s a step at one row and 50 at two: it binds the one-row steps (111 and 112 s)
    host = ([1, 2], [150.0, 50.0])
    *_, bound = predict(lens, outs, rate, fixed, kv_bytes_per_token=1, prefill_s=5.0, host=host)
    assert bound == (15.0 + 200.0) + 150.0 + 150.0 + 5.0


def test_the_host_cost_is_the_busy_time_of_the_named_runs_by_bucket(tmp_path) -> None:
    bucket = lambda batches, us: {"batches": batches, "host_busy_us": us}  # noqa: E731
    runs = {
        "abc_1": {"buckets": [bucket("1-16", 1000.0), bucket("17-32", 2000.0)]},
        "abc_2": {"buckets": [bucket("1-16", 3000.0), bucket("17-32", 2000.0)]},
        "abcd": {"buckets": [bucket("1-16", 9e9)]},  # another run whose name only starts the same
    }
    (tmp_path / "host.json").write_text(json.dumps({"runs": runs}))
    sizes, busy = host_costs(str(tmp_path / "host.json"), "abc")
    assert sizes == [8.5, 24.5]
    assert np.allclose(busy, [2e-3, 2e-3])


def test_the_fixed_cost_is_the_graph_step_less_its_attention_launches(tmp_path) -> None:
    steps = {"steps": {"decode_bs64": {"graph_step_ms": 3.0}, "decode_bs256": {"graph_step_ms": 7.0}}}
    order = [
        {"bs": 64, "fp8": False, "chosen": True, "us": 50.0},
        {"bs": 64, "fp8": False, "chosen": False, "us": 40.0},  # another split count: not the engine's
        {"bs": 64, "fp8": True, "chosen": True, "us": 30.0},
        {"bs": 256, "fp8": False, "chosen": True, "us": 200.0},
        {"bs": 96, "fp8": False, "chosen": True, "us": 90.0},  # no graph step measured at 96
    ]
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    (tmp_path / "order.json").write_text(json.dumps(order))
    sizes, costs = fixed_costs(str(tmp_path / "steps.json"), str(tmp_path / "order.json"))
    assert sizes == [64, 256]
    assert np.allclose(costs, [3.0e-3 - 28 * 50e-6, 7.0e-3 - 28 * 200e-6])
