"""The upstream workload's decode time predicted from measured kernel rates, and what a faster kernel would give.

    python benchmark/offline/workload_model.py [--order docs/results/gpu_qwen3_0.6b_decode_order_2026-12-03.json]
        [--steps docs/results/gpu_qwen3_0.6b_steps_2026-12-03.json] [--prefill-s 0.35]
        [--tc-bf16 docs/results/gpu_decode_tc_bf16_2026-12-04.json]
        [--tc-fp8 docs/results/gpu_decode_tc_whole_rows_engine_2026-12-04.json]
        [--host docs/results/gpu_qwen3_0.6b_host_by_batch_2026-12-04.json] [--host-run cb44088]

Runs on any machine (no GPU): it reads two measurements of the Qwen3-0.6B shape on the workload's contexts
halfway, by batch size, and walks the workload's 1,024 decode steps (every request decodes until its output
length; batch and contexts from the requests still running):
- decode attention's read rate at each batch (`decode_splits.py --sweep order`: TB/s in batch order and longest
  first, each pool), times the step's KV bytes;
- the rest of the step ("fixed": GEMMs, LM head, norms, rotary, SiLU, sampling), the graph step
  (`roofline.py --sections steps`) less its 28 attention launches in batch order.
Plus the prefill's GPU time (`--prefill-s`, measured 0.31-0.40 s). Each row is the predicted workload time
and output tokens/s; the what-if rows show how far a change in one part would move it, before writing it.
The last two columns bound each step by the host too: under the overlap loop a step takes the longer of the
device's step and the host's busy time a step at that batch (`--host`: trace_steps.py's buckets of a traced run,
the runs named `--host-run`, averaged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roofline import workload  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128  # Qwen3-0.6B


def rates(order_json: str, fp8: bool, ordered: bool) -> tuple[list[int], list[float]]:
    """Batch sizes and decode attention's read rate (bytes/s of the pool) at the engine's split count."""
    rows = [r for r in json.load(open(order_json)) if r["chosen"] and r["fp8"] == fp8]
    rows.sort(key=lambda r: r["bs"])
    key = "tb_s_ordered" if ordered else "tb_s"
    return [r["bs"] for r in rows], [r[key] * 1e12 for r in rows]


def tc_rates(tc_json: str, group: int = 2) -> tuple[list[int], list[float]]:
    """Batch sizes and the tensor-core decode kernel's read rate (`decode_tc.py --json`, the engine's slots), the
    variant the engine takes at each batch (decode.py's TensorCoreDecode.variant)."""
    best: dict[int, float] = {}
    for r in json.load(open(tc_json)):
        engine_slots = r.get("layout", "engine") == "engine"
        # the engine's two variants: the faster of them at each measured size
        if r.get("group") == group and engine_slots and r.get("kernel", "").startswith("tc "):
            best[r["bs"]] = max(best.get(r["bs"], 0.0), r["tb_s"])
    sizes = sorted(best)
    return sizes, [best[bs] * 1e12 for bs in sizes]


def fixed_costs(steps_json: str, order_json: str) -> tuple[list[int], list[float]]:
    """Batch sizes and the seconds of a bf16 graph step that are not attention (batch order both)."""
    steps = json.load(open(steps_json))["steps"]
    attn = {r["bs"]: r["us"] for r in json.load(open(order_json)) if r["chosen"] and not r["fp8"]}
    sizes = sorted(bs for bs in attn if f"decode_bs{bs}" in steps)
    return sizes, [steps[f"decode_bs{bs}"]["graph_step_ms"] * 1e-3 - LAYERS * attn[bs] * 1e-6 for bs in sizes]


def host_costs(host_json: str, run: str) -> tuple[list[float], list[float]]:
    """Batch sizes (each bucket's middle) and the host's busy seconds a decode step, averaged over the runs whose
    name starts with `run` (trace_steps.py's `host_busy_us`)."""
    runs = [v for k, v in json.load(open(host_json))["runs"].items() if k == run or k.startswith(run + "_")]
    busy: dict[float, list[float]] = {}
    for r in runs:
        for b in r["buckets"]:
            lo, hi = (int(x) for x in b["batches"].split("-"))
            busy.setdefault((lo + hi) / 2, []).append(b["host_busy_us"] * 1e-6)
    sizes = sorted(busy)
    return sizes, [sum(busy[bs]) / len(busy[bs]) for bs in sizes]


def predict(
    lens: np.ndarray,
    outs: np.ndarray,
    rate: tuple[list[int], list[float]],
    fixed: tuple[list[int], list[float]],
    kv_bytes_per_token: int,
    prefill_s: float,
    host: tuple[list[float], list[float]] | None = None,
) -> tuple[float, float, float, float]:
    """(attention seconds, fixed seconds, whole workload seconds, the same with each step at least the host's
    busy time) over the decode steps."""
    attn = rest = bound = 0.0
    for step in range(int(outs.max())):
        running = outs > step
        bs = int(running.sum())
        kv = float((lens[running] + step).sum()) * kv_bytes_per_token
        a = kv / float(np.interp(bs, *rate))
        f = float(np.interp(bs, *fixed))
        attn, rest = attn + a, rest + f
        bound += max(a + f, float(np.interp(bs, *host))) if host is not None else a + f
    return attn, rest, attn + rest + prefill_s, bound + prefill_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--order", default="docs/results/gpu_qwen3_0.6b_decode_order_2026-12-03.json")
    p.add_argument("--steps", default="docs/results/gpu_qwen3_0.6b_steps_2026-12-03.json")
    p.add_argument("--prefill-s", type=float, default=0.35)
    p.add_argument("--tc-bf16", default="docs/results/gpu_decode_tc_bf16_2026-12-04.json")
    p.add_argument("--tc-fp8", default="docs/results/gpu_decode_tc_whole_rows_engine_2026-12-04.json")
    p.add_argument("--host", default="docs/results/gpu_qwen3_0.6b_host_by_batch_2026-12-04.json")
    p.add_argument("--host-run", default="cb44088", help="the runs of --host whose names start with this")
    args = p.parse_args()
    prompts, out_lens = workload()
    lens, outs = np.array([len(x) for x in prompts]), np.array(out_lens)
    tokens = int(outs.sum())
    copy = json.load(open(args.steps))["ceilings"]["copy_tb_s"] * 1e12
    fixed = fixed_costs(args.steps, args.order)
    print(f"fixed cost a step (s) by batch: {dict(zip(fixed[0], (round(f * 1e3, 3) for f in fixed[1])))} ms")
    half = (fixed[0], [f / 2 for f in fixed[1]])
    host = host_costs(args.host, args.host_run)
    print(f"host busy a step (s) by batch: {dict(zip(host[0], (round(h * 1e3, 3) for h in host[1])))} ms")
    print(
        f"{'case':58s} {'attention':>9s} {'fixed':>7s} {'total':>7s} {'tok/s':>8s} {'w/ host':>7s} {'tok/s':>8s}"
    )
    for pool, fp8 in (("bf16", False), ("FP8", True)):
        per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
        sizes = rates(args.order, fp8, False)[0]
        at_copy = (sizes, [copy] * len(sizes))
        tc = tc_rates(args.tc_fp8 if fp8 else args.tc_bf16)
        cases = [
            ("batch order (as measured)", rates(args.order, fp8, False), fixed),
            ("longest first (as measured)", rates(args.order, fp8, True), fixed),
            ("tensor-core kernel (as measured)", tc, fixed),
            ("attention at the copy rate", at_copy, fixed),
            ("longest first, the fixed cost halved", rates(args.order, fp8, True), half),
            ("tensor-core kernel, the fixed cost halved", tc, half),
            ("attention at the copy rate, the fixed cost halved", at_copy, half),
        ]
        for name, rate, rest in cases:
            a, f, t, h = predict(lens, outs, rate, rest, per_token, args.prefill_s, host)
            print(
                f"{pool + ': ' + name:58s} {a:8.2f}s {f:6.2f}s {t:6.2f}s {tokens / t:8.0f} {h:6.2f}s {tokens / h:8.0f}"
            )


if __name__ == "__main__":
    main()
