"""Decode GEMMs of 1-16 rows against the GPU's read ceiling: which kernel shape streams a weight fastest.

    python benchmark/offline/gemv_variants.py [--models llama3-8b,qwen3-0.6b] [--rows 1,2,4,8,16] [--json out.json]

read_rate.py puts the H200's read-only ceiling at ~4.48 TB/s, reached by many programs each streaming a few
4 KB blocks, while a decode step's GEMMs read their weights at 3.6-3.7 TB/s (Llama-3-8B shape, 1-16 rows).
For every projection of a model shape, each layer its own weights, in CUDA graphs, timed here: cuBLAS,
the engine's split-K kernel (kernel/gemm.py) with its own tiles and with 2-8 times the programs, and a
kernel without tensor cores (`_gemv_kernel`: each program a few weight rows over one K range, the rows'
products summed on the CUDA cores, the same last-ticket split sum as the engine's) over its block shapes
and program counts. Every output is checked against a float32 product first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import MODELS, graph_ms  # noqa: E402

from minisgl.kernel import gemm  # noqa: E402


@triton.jit
def _gemv_kernel(
    X,
    W,
    Y,
    Part,
    Counters,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    k_per_split,
    split,
    split_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_start + rk)[None, :]
    x_ptrs = X + rm[:, None] * stride_xm + (k_start + rk)[None, :]
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + rk)[None, :] < k_end
        w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    rm2 = tl.arange(0, BLOCK_M)[:, None]
    rn2 = rn[None, :]
    out_mask = (rm2 < M) & (rn2 < N)
    offs = rm2 * N + rn2
    tl.store(Part + pid_k * split_stride + offs, acc, mask=out_mask)
    tl.debug_barrier()
    ticket = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == split - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(split):
            total += tl.load(Part + s * split_stride + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(Y + rm2 * stride_ym + rn2, total.to(Y.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(Counters + pid_n, 0, sem="relaxed", scope="gpu")


_PART: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def gemv(
    x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, programs: int, warps: int
) -> torch.Tensor:
    """x [M, K] @ w.T on the CUDA cores, about `programs` programs (row blocks times K splits)."""
    m, k = x.shape
    n = w.shape[0]
    if x.device not in _PART:
        _PART[x.device] = (
            torch.empty(32 << 20, dtype=torch.float32, device=x.device),
            torch.zeros(1 << 16, dtype=torch.int32, device=x.device),
        )
    part, counters = _PART[x.device]
    grid_n = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(k, block_k), programs // grid_n))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(grid_n, split)](
        x, w, y, part, counters, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split, split, m * n,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,qwen3-0.6b")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(dev), "models": {}}
    for name in args.models.split(","):
        layers, shapes = MODELS[name]
        results["models"][name] = {}
        for n, k in shapes:
            ws = [
                torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
                for _ in range(layers)
            ]
            gb = n * k * 2 * layers / 1e9
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
                ref = x.float() @ ws[0].float().T
                variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                    "cublas": lambda w, x=x: F.linear(x, w)
                }
                base = gemm.choose_config(m, n, k, sms)
                for mult in (1, 2, 4, 8):
                    cfg = gemm.GemmConfig(base.block_m, base.block_n, base.block_k, base.split * mult)
                    variants[f"splitk x{mult}"] = lambda w, x=x, cfg=cfg: gemm.skinny_matmul(x, w, cfg)
                if m <= 4:
                    for bn, bk, warps in ((4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8)):
                        for per_sm in (2, 4, 8, 16):
                            key = f"gemv {bn}x{bk} w{warps} {per_sm}/SM"
                            variants[key] = lambda w, x=x, a=(bn, bk, per_sm * sms, warps): gemv(x, w, *a)
                timed: dict[str, float] = {}
                for key, fn in variants.items():
                    err = ((fn(ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2:
                        raise SystemExit(f"{name} {n}x{k} M={m} {key}: relative error {err:.3g}")

                    def run(fn: Callable[[torch.Tensor], torch.Tensor] = fn, ws: list = ws) -> None:
                        for w in ws:
                            fn(w)

                    timed[key] = graph_ms(run) / layers * 1e3
                best = min(timed, key=lambda kk: timed[kk])
                results["models"][name].setdefault(f"{n}x{k}", {})[m] = timed
                print(
                    f"{name} {n}x{k} M={m:2d}: cuBLAS {timed['cublas']:6.1f} us "
                    f"({gb / layers / timed['cublas'] * 1e3:4.2f} TB/s), split-K {timed['splitk x1']:6.1f}, "
                    f"best {best} {timed[best]:6.1f} us ({gb / layers / timed[best] * 1e3:4.2f} TB/s)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
