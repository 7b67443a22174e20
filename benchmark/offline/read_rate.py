"""How fast a GPU reads memory it does not write: the ceiling of a decode step's weight and KV reads.

    python benchmark/offline/read_rate.py [--gib 4] [--json out.json]

The roofline's ceiling is a device copy (bytes read plus written); a decode step only reads its weights
and KV cache, and a read-only stream may go faster than a copy's mixed traffic. Timed here, on `--gib`
GiB of bf16 (far past the L2): torch's copy and sum, and a Triton kernel that sums the tensor with
programs of several sizes (grid-stride, a fixed number of programs an SM, or one block a program), so the
fastest read pattern gives the ceiling a GEMM's weight stream can aim at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import bench_ms  # noqa: E402


@triton.jit
def _sum_kernel(X, Out, n, per_program, BLOCK: tl.constexpr):
    # each program sums its contiguous range of `per_program` elements, BLOCK at a time
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for i in range(0, per_program, BLOCK):
        idx = start + i + offs
        acc += tl.load(X + idx, mask=idx < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(Out + pid, tl.sum(acc))


def triton_sum_ms(x: torch.Tensor, programs: int, block: int, warps: int, stages: int) -> float:
    n = x.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    grid = triton.cdiv(n, per)
    out = torch.empty(grid, dtype=torch.float32, device=x.device)

    def run() -> None:
        _sum_kernel[(grid,)](x, out, n, per, BLOCK=block, num_warps=warps, num_stages=stages)

    run()
    torch.testing.assert_close(out.sum(), x.float().sum(), rtol=1e-3, atol=1.0)
    return bench_ms(run, iters=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 2
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gb = n * 2 / 1e9
    rates: dict[str, float] = {}
    rates["torch copy (read + write)"] = 2 * gb / bench_ms(lambda: y.copy_(x), iters=10)
    rates["torch sum"] = gb / bench_ms(lambda: x.sum(), iters=10)
    for per_sm in (1, 2, 4, 8, 0):
        for block, warps in ((2048, 4), (8192, 8)):
            for stages in (1, 3):
                programs = per_sm * sms if per_sm else triton.cdiv(n, block * 8)  # 0: 8 blocks a program
                key = f"triton sum, {per_sm or 'many'} a SM, block {block}, {warps} warps, {stages} stages"
                rates[key] = gb / triton_sum_ms(x, programs, block, warps, stages)
    for key, tb_s in rates.items():
        print(f"{key:<60} {tb_s:6.3f} TB/s", flush=True)
    best = max((k for k in rates if k.startswith("triton")), key=lambda k: rates[k])
    print(f"fastest read: {best}: {rates[best]:.3f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gib": args.gib, "tb_s": rates}, f, indent=2)


if __name__ == "__main__":
    main()
