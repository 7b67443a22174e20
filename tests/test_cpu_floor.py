"""The CPU floor of benchmark/offline/bench.py --scenarios: each step takes the longer of its reads and
its FLOPs, and a request stops costing anything once it has its tokens."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "offline"))

from cpu_floor import Machine, ModelCost, floor_seconds  # noqa: E402

# one layer, one head of size 4: 2 x 1 x 1 x 4 x 2 = 16 bytes of K/V a token, 16 attention FLOPs a pair
COST = ModelCost(weight_bytes=1000, matmul_params=10, layers=1, qo_heads=1, kv_heads=1, head_dim=4)


def test_a_memory_bound_run_reads_the_weights_and_the_contexts_once_a_step() -> None:
    m = Machine(bytes_per_s=1.0, flops=1e12)
    # prefill of 2 + 3 tokens, then steps 1 and 2 with contexts 3 + 4 and 4 + 5 (both want 3 tokens)
    reads = (1000 + 5 * 16) + (1000 + 7 * 16) + (1000 + 9 * 16)
    assert floor_seconds(m, COST, [2, 3], [3, 3]) == pytest.approx(reads)


def test_a_finished_request_leaves_the_later_steps() -> None:
    m = Machine(bytes_per_s=1.0, flops=1e12)
    # the first request's one token comes from the prefill; only the second runs step 1 (context 4)
    reads = (1000 + 5 * 16) + (1000 + 4 * 16)
    assert floor_seconds(m, COST, [2, 3], [1, 2]) == pytest.approx(reads)


def test_a_compute_bound_prefill_counts_matmuls_and_causal_attention() -> None:
    m = Machine(bytes_per_s=1e12, flops=1.0)
    # 2 x 10 weights x 4 tokens, and 4 x 4 FLOPs for each of 4 * 4 // 2 query-key pairs
    assert floor_seconds(m, COST, [4], [1]) == pytest.approx(2 * 10 * 4 + 16 * 8)
