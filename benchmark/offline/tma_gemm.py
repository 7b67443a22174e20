"""Decode products through the tensor memory accelerator (Triton's tensor descriptors) against cuBLAS, on Hopper.

    python benchmark/offline/tma_gemm.py [--rows 16,32,64,128,256] [--json out.json]

Why: from 17 rows the decode products are cuBLAS's, 5.4-8 us each for 4-12 MB of weight (docs/benchmarks.md, "A
decode GEMM on the tensor cores"), and the Triton and mma.sync tiles tried so far lost to it from 32 rows, both
loading their tiles with cp.async and multiplying with mma.sync. Here the weight's rows are the warpgroup
product's M side (64 or 128 rows a program, so Triton emits wgmma) and the tokens its N side (16-256), the tiles
come in by the copy engine (host-made tensor descriptors: rows past the batch arrive as zeros), K may be split
over programs whose float32 partials the last program of a tile adds in split order (as kernel/gemm.py does).

Checked first, every configuration against float32 sums (and the residual written over itself); then each product
kind alone (28 layers, each its own weights, in a CUDA graph) by cuBLAS and every configuration; then a step's chain
(q|k|v, o with the residual, gate|up, down with the residual: gemm_pdl.py's) by cuBLAS and by each kind's fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemm_pdl import LAYERS, SHAPES, chain_buffers, cublas_layer  # noqa: E402
from skinny_gemm import graph_ms  # noqa: E402

_WORKSPACE = 8 << 20
_COUNTERS = 1 << 14


@dataclass(frozen=True)
class Config:
    bw: int  # weight rows a program (the product's M side)
    bt: int  # tokens a program (its N side)
    bk: int
    split: int
    stages: int

    @property
    def warps(self) -> int:
        return 8 if self.bw >= 128 and self.bt >= 128 else 4

    @property
    def shared(self) -> int:
        return (self.bw + self.bt) * self.bk * 2 * self.stages


@triton.jit
def _tma_gemm(
    w_desc,
    x_desc,
    Y,
    R,
    Part,
    Counters,
    M,
    N,
    k_per_split,
    split,
    stride_ym,
    HAS_SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr,
    BW: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
):
    # token tiles vary fastest: the programs of one weight tile run side by side and read it from DRAM once
    pid_t = tl.program_id(0)
    pid_w = tl.program_id(1)
    pid_k = tl.program_id(2)
    off_w = pid_w * BW
    off_t = pid_t * BT
    k0 = pid_k * k_per_split
    acc = tl.zeros((BW, BT), dtype=tl.float32)
    for kk in tl.range(0, k_per_split, BK, num_stages=STAGES):
        w = w_desc.load([off_w, k0 + kk])
        x = x_desc.load([off_t, k0 + kk])
        acc = tl.dot(w, x.T, acc)
    rw = off_w + tl.arange(0, BW)
    rt = off_t + tl.arange(0, BT)
    mask = (rt[None, :] < M) & (rw[:, None] < N)
    y_ptrs = Y + rt[None, :].to(tl.int64) * stride_ym + rw[:, None]
    if not HAS_SPLIT:
        if HAS_RES:
            acc += tl.load(R + rt[None, :].to(tl.int64) * stride_ym + rw[:, None], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        offs = rt[None, :] * N + rw[:, None]
        stride_s = M * N
        tl.store(Part + pid_k * stride_s + offs, acc, mask=mask)
        tl.debug_barrier()
        tile = pid_w * tl.num_programs(0) + pid_t
        ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:
            total = tl.zeros((BW, BT), dtype=tl.float32)
            for s in range(split):
                total += tl.load(Part + s * stride_s + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_RES:
                total += tl.load(
                    R + rt[None, :].to(tl.int64) * stride_ym + rw[:, None], mask=mask, other=0.0
                ).to(tl.float32)
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")


_state: dict[str, torch.Tensor] = {}


def tma_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, c: Config, add: bool = False) -> object:
    """out = x @ w.T (out += x @ w.T with `add`); x [M, K] rows 16-byte aligned, w [N, K] contiguous."""
    m, k = x.shape
    n = w.shape[0]
    if "part" not in _state:
        _state["part"] = torch.empty(_WORKSPACE, dtype=torch.float32, device=x.device)
        _state["counters"] = torch.zeros(_COUNTERS, dtype=torch.int32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split), c.bk) * c.bk
    split = triton.cdiv(k, k_per_split)
    assert split * m * n <= _WORKSPACE
    w_desc = TensorDescriptor.from_tensor(w, [c.bw, c.bk])
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [c.bt, c.bk])
    grid = (triton.cdiv(m, c.bt), triton.cdiv(n, c.bw), split)
    return _tma_gemm[grid](
        w_desc, x_desc, out, out, _state["part"], _state["counters"], m, n, k_per_split, split, out.stride(0),
        HAS_SPLIT=split > 1, HAS_RES=add, BW=c.bw, BT=c.bt, BK=c.bk, STAGES=c.stages, num_warps=c.warps,
        num_stages=c.stages,
    )  # fmt: skip


def configs_for(m: int, n: int, k: int, sms: int) -> list[Config]:
    """Weight tiles of 64 or 128 rows; token tiles covering the batch (at most 256), or 128; K blocks of 64
    or 128; 1-8 splits while the grid stays within two programs an SM; 3 or 4 stages within 200 KB."""
    pad = max(16, triton.next_power_of_2(m))
    out = []
    for bt in sorted({min(pad, 256), min(pad, 128)}):
        for bw in (64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4, 8):
                    if k // split < bk:
                        continue
                    programs = triton.cdiv(m, bt) * triton.cdiv(n, bw) * split
                    if programs > 2 * sms:
                        continue
                    for stages in (3, 4):
                        c = Config(bw, bt, bk, split, stages)
                        if c.shared <= 200 * 1024:
                            out.append(c)
    return out


def check(x: torch.Tensor, w: torch.Tensor, c: Config) -> float:
    """The configuration's relative error against float32 sums, with the residual in place."""
    ref = x.float() @ w.float().T
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    tma_matmul(x, w, out, c)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    res = torch.randn_like(out)
    expect = res.float() + ref
    tma_matmul(x, w, res, c, add=True)
    return max(err, ((res.float() - expect).abs().max() / expect.abs().max()).item())


def time_kind(m: int, key: str, weights: list[dict[str, torch.Tensor]], sms: int) -> tuple[dict, Config]:
    """One product kind at `m` rows: cuBLAS and every configuration (checked first), 28 layers in a CUDA graph."""
    n, k = SHAPES[key]
    dev = weights[0][key].device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    ws = [lw[key] for lw in weights]
    cublas_us = graph_ms(lambda: [torch.mm(x, w.t(), out=out) for w in ws]) / LAYERS * 1e3
    timed: dict[str, float] = {}
    bad = []
    for c in configs_for(m, n, k, sms):
        try:
            err = check(x, ws[0], c)
            if err > 1e-2:
                bad.append((asdict(c), err))
                continue
            timed[json.dumps(asdict(c))] = (
                graph_ms(lambda c=c: [tma_matmul(x, w, out, c) for w in ws]) / LAYERS * 1e3
            )
        except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:
            bad.append((asdict(c), type(e).__name__))
    best = min(timed, key=timed.get)
    plan = Config(**json.loads(best))
    ptx = tma_matmul(x, ws[0], out, plan).asm.get("ptx", "")
    kinds = {"wgmma": "wgmma.mma_async" in ptx, "bulk_tensor": "cp.async.bulk.tensor" in ptx}
    ranked = sorted(timed, key=timed.get)
    print(
        f"rows {m:4d} {key:8s} ({n}x{k}): cuBLAS {cublas_us:.2f} us, TMA best {timed[best]:.2f} us {best} {kinds}; "
        "next " + ", ".join(f"{timed[r]:.2f}" for r in ranked[1:4]) + f"; {len(bad)} failed",
        flush=True,
    )
    return {"cublas_us": cublas_us, "us": timed, "best": best, "ptx": kinds, "failed": bad}, plan


def time_chain(m: int, weights: list[dict[str, torch.Tensor]], plan: dict[str, Config]) -> dict:
    """A step's 112 products with real dependencies, by cuBLAS and by each kind's fastest configuration."""
    h0, h, qkv, gu = chain_buffers(m)

    def chain(mode: str) -> None:
        for lw in weights:
            if mode == "cublas":
                cublas_layer(h, qkv, gu, lw)
            else:
                tma_matmul(h, lw["qkv"], qkv, plan["qkv"])
                tma_matmul(qkv[:, :2048], lw["o"], h, plan["o"], add=True)
                tma_matmul(h, lw["gate_up"], gu, plan["gate_up"])
                tma_matmul(gu[:, :3072], lw["down"], h, plan["down"], add=True)

    finals = {}
    for mode in ("cublas", "tma"):
        h.copy_(h0)
        chain(mode)
        torch.cuda.synchronize()
        finals[mode] = h.float().clone()
    out: dict = {mode: graph_ms(lambda mode=mode: chain(mode)) for mode in ("cublas", "tma")}
    out["rel_err"] = ((finals["tma"] - finals["cublas"]).norm() / finals["cublas"].norm()).item()
    print(
        f"rows {m:4d}: a step's 112 products cuBLAS {out['cublas']:.3f} ms, TMA {out['tma']:.3f} ms "
        f"(against cuBLAS {out['rel_err']:.1e})",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    weights = [
        {
            key: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * (0.5 * k**-0.5)
            for key, (n, k) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]
    results: dict = {"device": torch.cuda.get_device_name(dev), "rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        entry: dict = {"kinds": {}}
        plan: dict[str, Config] = {}
        for key in SHAPES:
            entry["kinds"][key], plan[key] = time_kind(m, key, weights, sms)
        entry["chain"] = time_chain(m, weights, plan)
        results["rows"][m] = entry
        if args.json:  # written after every size: a call cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
