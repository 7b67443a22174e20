"""Where a step's GPU time goes, kernel by kernel: the upstream workload through `LLM.generate`, with the
torch profiler (CUPTI) around one prefill step and one decode step at the full batch (a CUDA graph's
kernels are reported one by one).

    python benchmark/offline/kernel_profile.py --model FOLDER [--kv-cache-dtype fp8_e4m3] [--json out.json]
        [--decode-batches 256,64]

Prints, for each profiled step, its kernels grouped by name (total microseconds, launches, share of the
step's kernel time) and the step's kernel time against its wall time between the two synchronisations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def sync() -> None:
    if torch.cuda.is_available():  # the script's plumbing also runs on a CPU, with no kernels to list
        torch.cuda.synchronize()


def kernel_span_us(prof: Any) -> float:
    """From the first kernel's start to the last one's end: with the kernels' own total, what the device
    spent between kernels (launch gaps inside a graph, or waiting for the host)."""
    spans = [
        (ev.time_range.start, ev.time_range.end)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    return max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0


def kernel_table(prof: Any) -> list[dict[str, Any]]:
    """Every CUDA kernel event of the trace, grouped by name, largest total first."""
    rows: dict[str, dict[str, Any]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = rows.setdefault(ev.name, {"name": ev.name[:90], "us": 0.0, "count": 0})
        row["us"] += ev.device_time
        row["count"] += 1
    return sorted(rows.values(), key=lambda r: -r["us"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--decode-step", type=int, default=100, help="profile the Nth decode step of the full batch"
    )
    p.add_argument("--requests", type=int, default=256)
    p.add_argument(
        "--decode-batches",
        default=None,
        help="comma-separated batch sizes: besides the full batch's step, profile the first decode step at or "
        "below each (the batch shrinks as requests finish)",
    )
    p.add_argument("--json")
    args = p.parse_args()

    from bench import make_workload

    from minisgl import LLM, SamplingParams

    smaller = sorted((int(b) for b in (args.decode_batches or "").split(",") if b), reverse=True)
    smaller = [b for b in smaller if b < args.requests]
    llm = LLM(
        args.model,
        max_running_req=args.requests,
        cache_type="naive",
        max_seq_len_override=2056,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    work = make_workload(args.requests, 100, 1024, llm.engine.model_config.vocab_size, 0)
    forward = llm.engine.forward_batch
    seen = {"prefill": 0, "decode": 0}
    want = {"prefill": 3, "decode": args.decode_step}
    result: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}

    def profiled(forward_input: Any) -> Any:
        batch = forward_input.batch
        phase = batch.phase
        key = phase
        if phase == "decode" and smaller and batch.size <= smaller[0]:
            key = f"decode_{smaller.pop(0)}"  # the first step at or below the next size asked for
        else:
            full = phase == "prefill" or batch.size == args.requests
            seen[phase] += full
            if not full or seen[phase] != want[phase]:
                return forward(forward_input)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            out = forward(forward_input)
            sync()
            wall_us = (time.perf_counter() - t0) * 1e6
        table = kernel_table(prof)
        total = max(sum(r["us"] for r in table), 1e-9)  # none without CUDA
        # a decode graph gathers its token ids itself: a decode step's tokens are its rows
        tokens = int(batch.input_ids.numel()) if batch.is_prefill else batch.size
        span = kernel_span_us(prof)
        result[key] = {
            "batch": batch.size,
            "tokens": tokens,
            "wall_us": wall_us,
            "kernel_us": total,
            "span_us": span,
            "launches": sum(r["count"] for r in table),
        }
        result[key]["kernels"] = table
        print(
            f"{phase} step, batch {batch.size}: kernels {total:.0f} us of {wall_us:.0f} us wall, "
            f"{result[key]['launches']} kernels in a span of {span:.0f} us",
            flush=True,
        )
        for r in table[:14]:
            print(
                f"  {r['us']:9.1f} us {r['count']:5d}x {100 * r['us'] / total:5.1f}%  {r['name']}", flush=True
            )
        return out

    llm.engine.forward_batch = profiled
    params = [
        SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i)
        for i, n in enumerate(work.output_lens)
    ]
    llm.generate(work.prompts, params)
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
