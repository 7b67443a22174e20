"""Prefill attention on one GPU: the paged extend kernel against torch's kernels over K/V copied out of the pool.

    python benchmark/offline/extend_flash.py [--json out.json]

Each case is one layer of a prefill step on the Qwen3-0.6B shape (16 query heads, 8 KV heads, head dim 128, a
bf16 pool of page size 1, each request's slots scattered over the pool): extend_sweep.py's cases (8k, 32k, chunk,
workload and its grid of requests of Q new tokens after a cached prefix of P, `qQ_pP`). For each: the extend kernel
(the engine's tiles); each request's context copied out of the pool (`gather`, both K and V) and the slots it needs
found on the device (`lookup`, once a step); over the copies, cuDNN's flash attention on the packed requests (K/V
with 8 heads, and repeated to 16) and torch's own flash kernel (`torch_flash`); `copy+torch_flash` both together,
what an engine path would take; where every request is fresh, fresh_attention.py's kernel over the copies (as the
step's own q|k|v rows; `fresh_MxN_Ww_Ss`, the tiles of --fresh-configs); and where the case is one fresh prompt
torch's SDPA through its flash and cuDNN backends. Printed: ms a layer (roofline.py's bench_ms: the median of 20
between CUDA events), TFLOP/s of the causal work, the largest difference from the extend kernel's output.
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

from extend_sweep import GRID_P, GRID_Q, case  # noqa: E402
from roofline import bench_ms  # noqa: E402

from minisgl.kernel import attention as attn  # noqa: E402
from minisgl.kernel import fresh_attention as fa  # noqa: E402

HQ, HK, D = 16, 8, 128
# fresh_attention.py's tiles timed on fresh cases (the first is the engine's); --fresh-configs replaces them
FRESH_CONFIGS = [fa.DEFAULT]


def context_slots(
    table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, cu_k: torch.Tensor, total: int
) -> torch.Tensor:
    """The pool slot of every context token, request by request, found on the device (no sync)."""
    req = torch.repeat_interleave(
        torch.arange(rows.shape[0], device=rows.device), lens.long(), output_size=total
    )
    pos = torch.arange(total, device=rows.device) - cu_k[req].long()
    return table[rows[req].long(), pos]


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
          max_q: int, max_k: int) -> torch.Tensor:  # fmt: skip
    """cuDNN's flash attention over packed requests, causal (its mask aligned to each request's first key)."""
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, True, False, scale=D**-0.5
    )[0]


def torch_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int) -> torch.Tensor:  # fmt: skip
    """torch's flash kernel over packed requests, causal (its mask aligned to each request's last key)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=D**-0.5
    )[0]


def run_case(name: str) -> dict[str, Any]:
    """One case's row: its sizes, each call's largest difference from the extend kernel, every timing."""
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
    slots = context_slots(table, rows, seq, cu_k, total)
    kc, vc = k.index_select(0, slots), v.index_select(0, slots)
    ke, ve = kc.repeat_interleave(HQ // HK, 1), vc.repeat_interleave(HQ // HK, 1)
    packed = (cu_q, cu_k, max(q_lens), max(lens))
    calls: dict[str, Callable[[], Any]] = {
        "engine": lambda: attn.extend_attention(q, k, v, table, rows, seq, starts, qn, max(q_lens), D**-0.5),
        "gather": lambda: (k.index_select(0, slots), v.index_select(0, slots)),
        "lookup": lambda: context_slots(table, rows, seq, cu_k, total),
        "cudnn_gqa": lambda: cudnn(q, kc, vc, *packed),
        "cudnn_repeated": lambda: cudnn(q, ke, ve, *packed),
        "torch_flash": lambda: torch_flash(q, kc, vc, *packed),
        "copy+torch_flash": lambda: torch_flash(
            q, k.index_select(0, slots), v.index_select(0, slots), *packed
        ),
    }
    if lens == q_lens:  # fresh prompts: the kernel over their own rows, each of the tiles asked for
        for cfg in FRESH_CONFIGS:

            def fresh_call(cfg: fa.FreshConfig = cfg) -> torch.Tensor:
                fa.FRESH_CONFIG = cfg
                try:
                    return fa.fresh_attention(q, kc, vc, starts, qn, max(q_lens), D**-0.5)
                finally:
                    fa.FRESH_CONFIG = None

            calls[f"fresh_{cfg.block_m}x{cfg.block_n}_{cfg.num_warps}w{cfg.num_stages}s"] = fresh_call
    if len(lens) == 1 and lens == q_lens:  # one fresh prompt: SDPA's causal mask is the same
        qs = q.view(1, -1, HQ, D).transpose(1, 2)
        ks = kc.view(1, -1, HK, D).transpose(1, 2)
        vs = vc.view(1, -1, HK, D).transpose(1, 2)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):

            def sdpa(backend: SDPBackend = backend) -> torch.Tensor:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                return out.transpose(1, 2).reshape(q.shape)

            calls[f"sdpa_{backend.name.lower()}"] = sdpa
    ref = calls["engine"]().float()
    row: dict[str, Any] = {
        "case": name,
        "requests": len(lens),
        "new_tokens": sum(q_lens),
        "context_tokens": total,
        "q_per_ctx": pairs / total,
        "tflop": 4 * D * HQ * pairs / 1e12,
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
    p.add_argument(
        "--fresh-configs",
        default="",
        help="fresh_attention.py tiles as m,n,warps,stages;... (default: the engine's)",
    )
    args = p.parse_args()
    if args.fresh_configs:
        FRESH_CONFIGS[:] = [fa.FreshConfig(*map(int, c.split(","))) for c in args.fresh_configs.split(";")]
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
        print(f"{name}: {row['requests']} req, q/ctx {row['q_per_ctx']:.0f}; "
              f"ms (TFLOP/s): {', '.join(parts)}; largest difference from the extend kernel: {diffs}"
              + (f"; errors: {errors}" if errors else ""), flush=True)  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
