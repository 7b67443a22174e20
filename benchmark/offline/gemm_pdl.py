"""A decode step's chain of products by cuBLAS, by minisgl/kernel/cuda/gemm.cu launched plainly, and programmatically.

    python benchmark/offline/gemm_pdl.py [--rows 1,16,64,128,256] [--json out.json]

phase_cost.py found that programmatic dependent launch lets a chain of weight-reading kernels stream at the copy
rate (2.07 us a read against 3.93 launched plainly). Here the reads are real products with real dependencies: 28
layers of the Qwen3-0.6B shape, each its own weights, h the hidden rows: q|k|v = h Wqkv^T; h += q Wo^T (q|k|v's
first 2,048 columns standing in for attention's output); gate|up = h Wgu^T; h += gate Wdown^T (its first 3,072
columns standing in for SiLU's), all in one CUDA graph. The tiles of each product are the fastest measured for it
by the sweep of docs/results/gpu_qwen3_0.6b_gemm_cuda_2026-12-04.json. Checked first: the programmatic chain's h
equal bit for bit to the plain chain's (the wait is where it must be), and both near cuBLAS's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import graph_ms  # noqa: E402

from minisgl.kernel.cuda import CudaModule, load_module, source  # noqa: E402

LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@dataclass(frozen=True)
class Config:
    bn: int
    bm: int
    wn: int
    wm: int
    split: int
    stages: int

    @staticmethod
    def parse(name: str) -> Config:
        # gemm_n{bn}_m{bm}_w{wn}x{wm}_s{split}_p{stages}
        _, n, m, w, s, p = name.split("_")
        wn, wm = w[1:].split("x")
        return Config(int(n[1:]), int(m[1:]), int(wn), int(wm), int(s[1:]), int(p[1:]))

    @property
    def name(self) -> str:
        return f"gemm_n{self.bn}_m{self.bm}_w{self.wn}x{self.wm}_s{self.split}_p{self.stages}"

    @property
    def shared(self) -> int:
        return max(self.stages * (self.bn + self.bm) * 128, self.bm * (self.bn + 4) * 4)


def best_configs(sweep: str, rows: int) -> dict[str, Config]:
    by_shape = {v: k for k, v in SHAPES.items()}
    return {
        by_shape[(r["n"], r["k"])]: Config.parse(r["best"])
        for r in json.load(open(sweep))
        if r.get("rows") == rows and "best" in r
    }


def chain_buffers(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain's buffers at `m` rows: the first hidden rows, the hidden rows, q|k|v's and gate|up's outputs."""
    dev = torch.device("cuda")
    h0 = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    qkv = torch.empty(m, 4096, device=dev, dtype=torch.bfloat16)
    gu = torch.empty(m, 6144, device=dev, dtype=torch.bfloat16)
    return h0, h0.clone(), qkv, gu


def cublas_layer(h: torch.Tensor, qkv: torch.Tensor, gu: torch.Tensor, lw: dict[str, torch.Tensor]) -> None:
    """A layer's four products by cuBLAS, attention's and SiLU's outputs stood in for by the products' columns."""
    torch.mm(h, lw["qkv"].t(), out=qkv)
    h.addmm_(qkv[:, :2048], lw["o"].t())
    torch.mm(h, lw["gate_up"].t(), out=gu)
    h.addmm_(gu[:, :3072], lw["down"].t())


def measure_chains(
    chain: Callable[[str], None], modes: tuple[str, ...], h: torch.Tensor, h0: torch.Tensor, row: dict
) -> dict:
    """`row` with each mode's chain checked (run once from h0: the programmatic chain's h equal to the plain
    chain's bit for bit, the plain chain's against cuBLAS's) and then timed in a CUDA graph (`{mode}_ms`)."""
    finals = {}
    for mode in modes:
        h.copy_(h0)
        chain(mode)
        torch.cuda.synchronize()
        finals[mode] = h.float().clone()
    row["programmatic_equals_plain"] = torch.equal(finals["plain"], finals["programmatic"])
    row["rel_err_vs_cublas"] = ((finals["plain"] - finals["cublas"]).norm() / finals["cublas"].norm()).item()
    for mode in modes:
        row[f"{mode}_ms"] = graph_ms(lambda mode=mode: chain(mode))
    return row


def run_rows(
    mod: CudaModule, weights: list[dict[str, torch.Tensor]], m: int, plan: dict[str, Config]
) -> dict:
    """The three chains at `m` rows: checked, then timed."""
    h0, h, qkv, gu = chain_buffers(m)

    def ours(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shape: str, add: bool, pdl: bool) -> None:
        c = plan[shape]
        n, k = w.shape
        a = (
            x.data_ptr(), w.data_ptr(), out.data_ptr(), out.data_ptr() if add else 0, ctypes.c_int32(m),
            ctypes.c_int32(k), ctypes.c_int64(x.stride(0)), ctypes.c_int64(w.stride(0)),
            ctypes.c_int64(out.stride(0)), ctypes.c_int64(out.stride(0)),
        )  # fmt: skip
        grid = (n // c.bn * c.split, -(-m // c.bm), 1)
        stream = torch.cuda.current_stream().cuda_stream
        mod.launch(c.name, grid, c.wn * c.wm * 32, a, stream, c.shared, programmatic=pdl)

    def chain(mode: str) -> None:
        for lw in weights:
            if mode == "cublas":
                cublas_layer(h, qkv, gu, lw)
            else:
                pdl = mode == "programmatic"
                ours(h, lw["qkv"], qkv, "qkv", False, pdl)
                ours(qkv[:, :2048], lw["o"], h, "o", True, pdl)
                ours(h, lw["gate_up"], gu, "gate_up", False, pdl)
                ours(gu[:, :3072], lw["down"], h, "down", True, pdl)

    configs = {k: c.name for k, c in plan.items()}
    row = measure_chains(chain, ("cublas", "plain", "programmatic"), h, h0, {"rows": m, "configs": configs})
    same, rel = row["programmatic_equals_plain"], row["rel_err_vs_cublas"]
    print(
        f"rows {m:4d}: a step's products cuBLAS {row['cublas_ms']:.3f} ms, ours {row['plain_ms']:.3f}, "
        f"ours programmatic {row['programmatic_ms']:.3f} (bits equal to plain: {same}; against cuBLAS {rel:.1e})",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--sweep", default="docs/results/gpu_qwen3_0.6b_gemm_cuda_2026-12-04.json")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    plans = {m: best_configs(args.sweep, m) for m in rows_list}
    configs = {c for p in plans.values() for c in p.values()}
    src = source("gemm.cu")
    src += "\n".join(
        f"GEMM_KERNEL({c.name}, {c.bn}, {c.bm}, {c.wn}, {c.wm}, {c.split}, {c.stages})" for c in configs
    )
    mod = load_module(src + "\n", "gemm_pdl.cu")
    for c in configs:
        mod.allow_shared(c.name, c.shared)
    weights = [
        {
            k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * (0.5 * kk**-0.5)
            for k, (n, kk) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]
    results = [run_rows(mod, weights, m, plans[m]) for m in rows_list]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
