"""The online benchmark: its synthetic trace has the distribution it states, and a run against a real
server counts every request, as a figure or as an error, and leaves no process behind."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

from procs import _descendants, _wait_gone

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "online")
sys.path.insert(0, BENCH)

from bench import model_vocab  # noqa: E402
from workload import TraceSpec, make_trace, send_times  # noqa: E402


def test_the_trace_has_the_stated_lengths_and_poisson_arrivals() -> None:
    spec = TraceSpec()
    trace = make_trace(4000, spec, seed=0, vocab=1000)
    inputs = [len(r.prompt) for r in trace]
    outputs = [r.output_len for r in trace]
    assert 0.9 * spec.input_median < statistics.median(inputs) < 1.1 * spec.input_median
    assert 0.9 * spec.output_median < statistics.median(outputs) < 1.1 * spec.output_median
    assert min(inputs) >= spec.min_len and max(inputs) == spec.input_max  # the tail reaches the cap
    assert min(outputs) >= spec.min_len and max(outputs) == spec.output_max
    assert all(0 <= t < 1000 for r in trace for t in r.prompt)
    # exponential gaps at rate 1: mean 1 and standard deviation 1
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:])]
    assert abs(statistics.mean(gaps) - 1) < 0.05 and abs(statistics.stdev(gaps) - 1) < 0.07
    # the same seed gives the same requests; rate r sends them r times sooner; inf all at once
    assert make_trace(50, spec, seed=0, vocab=1000) == trace[:50]
    assert make_trace(50, spec, seed=1, vocab=1000) != trace[:50]
    assert send_times(trace[:3], 4.0) == [r.arrival / 4 for r in trace[:3]]
    assert send_times(trace[:3], math.inf) == [0.0, 0.0, 0.0]


def test_a_run_counts_refused_requests_as_errors_and_stops_its_server(
    tiny_model: Callable[[str], str], tmp_path
) -> None:
    folder = tiny_model("llama")
    out = tmp_path / "levels.jsonl"
    # the closed-loop level (2 x 2 requests) asks for more tokens than the 512-token context: each is a 400
    cmd = [
        sys.executable,
        os.path.join(BENCH, "bench.py"),
        "--minisgl-args",
        f"--model {folder} --dtype float32 --max-running-req 8",
        "--prompt-ids",
        "--min-len",
        "4",
        "--max-len",
        "12",
        "--concurrency",
        "2",
        "--min-requests",
        "2",
        "--output-len",
        "600",
        "--request-rates",
        "inf",
        "--num-requests",
        "4",
        "--input-median",
        "8",
        "--output-median",
        "6",
        "--output-max",
        "10",
        "--json",
        str(out),
    ]
    before = _descendants(os.getpid())
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert _wait_gone(_descendants(os.getpid()) - before) == set()
    assert run.returncode == 1, run.stdout + run.stderr
    closed, rate = (json.loads(line) for line in out.read_text().splitlines())
    assert (closed["level"], closed["completed"], closed["errors"]) == ("c=2", 0, 4)
    assert "HTTP 400" in closed["error_reasons"][0] and "max_tokens" in closed["error_reasons"][0]
    assert "error (4x): HTTPError: HTTP 400" in run.stdout
    assert (rate["level"], rate["completed"], rate["errors"]) == ("rate=inf", 4, 0)
    # output tokens are the server's count: exactly what the trace asked for
    spec = TraceSpec(input_median=8, output_median=6, output_max=10)
    asked = sum(r.output_len for r in make_trace(4, spec, 0, model_vocab(folder)))
    assert rate["output_tokens"] == asked
    # a request's tokens may arrive in one coalesced chunk, whose TPOT is then 0
    assert 0 < rate["ttft_p50_ms"] <= rate["e2e_p50_ms"] and rate["tpot_p50_ms"] >= 0
