"""Prefill attention on one GPU: the paged extend kernel against torch's flash kernel over K/V copied out of the pool.

    python benchmark/offline/extend_flash.py [--json out.json]

Each case is one layer of a prefill step on the Qwen3-0.6B shape (16 query heads, 8 KV heads, head dim 128, a
bf16 pool of page size 1, each request's slots scattered a page at a time as a pool that has turned over places
them): the named cases of extend_sweep.py (8k, 32k, chunk, workload) and a grid of requests of Q new tokens after
a cached prefix of P (`qQ_pP`, about 8,192 new tokens a step). For each: the extend kernel (the engine's tiles),
the flash path as the engine runs it (`flash_extend`: both contexts gathered, then the varlen call), its parts
(the gather alone, the flash call alone), the step's slot lookup (`context_slots`, once a step, not a layer), and
where the case is one fresh prompt torch's SDPA through its flash and cuDNN backends on the same contiguous data.
Printed: ms a layer (roofline.py's bench_ms: the median of 20 between CUDA events), TFLOP/s of the causal work,
the largest difference from the extend kernel's output, and `q/ctx`, the queries a context token that
kernel/flash.py's `worth_it` weighs against MINISGL_FLASH_PREFILL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from extend_sweep import case as sweep_case  # noqa: E402
from roofline import bench_ms  # noqa: E402

from minisgl.kernel import attention as attn  # noqa: E402
from minisgl.kernel.flash import FlashExtend, _cudnn, context_slots, flash_extend, probe  # noqa: E402

HQ, HK, D = 16, 8, 128
GRID_Q = [16, 32, 64, 128, 256, 512, 1024]
GRID_P = [0, 1024, 4096]


def case(name: str) -> tuple[list[int], list[int]]:
    """(context lengths, new tokens) of each request."""
    if name.startswith("q"):
        q, p = (int(x) for x in name[1:].split("_p"))
        n = max(1, min(256, 8192 // q))
        return [p + q] * n, [q] * n
    return sweep_case(name)


def run_case(name: str) -> dict[str, Any]:
    """One case's row: its sizes, the flash path's largest difference from the extend kernel, every timing."""
    i32: dict[str, Any] = dict(dtype=torch.int32, device="cuda")
    lens, q_lens = case(name)
    total = sum(lens)
    k = torch.randn(total + 64, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    # a turned-over pool: each request's slots a shuffled set, not one run
    perm = torch.randperm(total + 64, device="cuda")[:total].to(torch.int32)
    table = torch.zeros(len(lens), max(lens), **i32)
    start = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HQ, D, dtype=torch.bfloat16, device="cuda")
    rows = torch.arange(len(lens), **i32)
    seq = torch.tensor(lens, **i32)
    starts = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))], **i32)
    qn = torch.tensor(q_lens, **i32)
    pairs = sum(m * (n - m) + m * (m + 1) // 2 for n, m in zip(lens, q_lens))
    cu_q = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], **i32)
    cu_k = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], **i32)
    support = probe(torch.device("cuda"), torch.bfloat16, D, HQ // HK)
    heads = None if support is None or support.gqa else torch.arange(HQ, device="cuda") // (HQ // HK)
    meta = FlashExtend(
        context_slots(table, rows, seq, cu_k, total), cu_q, cu_k, max(q_lens), max(lens), heads
    )
    kc, vc = k.index_select(0, meta.slots), v.index_select(0, meta.slots)
    ke, ve = kc.repeat_interleave(HQ // HK, 1), vc.repeat_interleave(HQ // HK, 1)
    calls: dict[str, Callable[[], Any]] = {
        "engine": lambda: attn.extend_attention(q, k, v, table, rows, seq, starts, qn, max(q_lens), D**-0.5),
        "flash_path": lambda: flash_extend(q, k, v, meta, D**-0.5),
        "gather": lambda: (k.index_select(0, meta.slots), v.index_select(0, meta.slots)),
        "cudnn_gqa": lambda: _cudnn(q, kc, vc, cu_q, cu_k, max(q_lens), max(lens), D**-0.5),
        "cudnn_repeated": lambda: _cudnn(q, ke, ve, cu_q, cu_k, max(q_lens), max(lens), D**-0.5),
        "torch_flash": lambda: torch.ops.aten._flash_attention_forward(
            q, kc, vc, cu_q, cu_k, max(q_lens), max(lens), 0.0, True, False, scale=D**-0.5
        )[0],
        "lookup": lambda: context_slots(table, rows, seq, cu_k, total),
    }
    if len(lens) == 1 and lens == q_lens:  # one fresh prompt: SDPA's causal mask is the same
        qs = q.view(1, -1, HQ, D).transpose(1, 2)
        ks = kc.view(1, -1, HK, D).transpose(1, 2)
        vs = vc.view(1, -1, HK, D).transpose(1, 2)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):

            def sdpa(backend: SDPBackend = backend) -> torch.Tensor:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

            calls[f"sdpa_{backend.name.lower()}"] = sdpa
    ref = calls["engine"]().float()
    row: dict[str, Any] = {
        "case": name,
        "requests": len(lens),
        "new_tokens": sum(q_lens),
        "context_tokens": total,
        "q_per_ctx": pairs / total,
        "tflop": 4 * D * HQ * pairs / 1e12,
        "support": None if support is None else [support.gqa, support.prefix],
    }
    for label, fn in calls.items():
        try:
            out = fn()
            if label not in ("gather", "lookup"):
                row[f"{label}_diff"] = (out.float() - ref).abs().max().item()
            row[f"{label}_ms"] = bench_ms(fn)
        except RuntimeError as e:  # a backend this build lacks is a row's note, not the end
            row[f"{label}_error"] = str(e)[:200]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = [f"q{q}_p{pp}" for pp in GRID_P for q in GRID_Q]
    p.add_argument("--cases", default=",".join(["8k", "32k", "chunk", "workload", *grid]))
    p.add_argument("--json")
    args = p.parse_args()
    results: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        row = run_case(name)
        results.append(row)
        tflop = row["tflop"]
        parts = []
        for key, ms in row.items():
            if key.endswith("_ms"):
                rate = "" if key in ("gather_ms", "lookup_ms") else f" ({tflop / ms * 1e3:.0f})"
                parts.append(f"{key[:-3]} {ms:.3f}{rate}")
        diffs = ", ".join(f"{key[:-5]} {d:.3g}" for key, d in row.items() if key.endswith("_diff"))
        errors = "; ".join(f"{key}: {e}" for key, e in row.items() if key.endswith("_error"))
        print(f"{name}: {row['requests']} req, q/ctx {row['q_per_ctx']:.0f}, cuDNN (gqa, prefix) {row['support']}; "
              f"ms (TFLOP/s): {', '.join(parts)}; largest difference from the extend kernel: {diffs}"
              + (f"; errors: {errors}" if errors else ""), flush=True)  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
