"""Decode products whose weight slice waits in shared memory (`gemm_ws.cu`) against cuBLAS, one product kind at a
time and as a step's chain, launched plainly and programmatically.

    python benchmark/offline/gemm_ws.py [--rows 16,32,64,96,128] [--json out.json]

Why: cuBLAS takes 5.4-8 us for each of a step's 4-12 MB products where the bytes need 1-3 (docs/benchmarks.md,
"A decode GEMM on the tensor cores"), and a chain of kernels that ask for their weight before they wait reads at
the copy rate when launched programmatically. gemm.cu's tiles lost to cuBLAS from 16 rows because every tile of
tokens read the weight again and every tile of weight rows the tokens; here a program holds all the tokens and a
slice of the weight (R rows by K / SPLIT columns, a cluster of SPLIT along K), about one program an SM, and asks
for the whole slice before it waits.

Checked first, each product against float32 sums (its error beside cuBLAS's) with and without the residual written
in place; then 28 layers of one product kind (each layer its own weights) in a CUDA graph by cuBLAS and by each
candidate slice; then the step's chain of the fastest (q|k|v = h Wqkv^T; h += q Wo^T with q|k|v's first 2,048
columns standing in for attention's output; gate|up = h Wgu^T; h += gate Wdown^T with its first 3,072 columns
standing in for SiLU's), by cuBLAS, plainly and programmatically, the programmatic chain's h equal to the plain
chain's bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemm_pdl import chain_buffers, cublas_layer, measure_chains  # noqa: E402
from skinny_gemm import graph_ms  # noqa: E402

from minisgl.kernel.cuda import CudaModule, load_module, source  # noqa: E402
from minisgl.kernel.cuda import gemm as cuda_gemm  # noqa: E402
from minisgl.layers.linear import linear, linear_add  # noqa: E402

LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
# (weight rows a program, programs a cluster along K) for each shape: about 128 programs, a slice of at most 100 KB
CANDIDATES = {
    "qkv": [(64, 2), (128, 4), (64, 1), (128, 2)],
    "o": [(64, 4), (64, 8), (64, 2)],
    "gate_up": [(64, 1), (128, 2)],
    "down": [(64, 4), (64, 8), (64, 6)],
}
MRS = (16, 32, 64, 128)
THREADS = 256


@dataclass(frozen=True)
class Slice:
    r: int
    ks: int
    split: int
    mr: int

    @property
    def warps(self) -> tuple[int, int]:
        """(WM, WK): warps along the tokens (a warp 16 tokens, or 32 with 64 weight rows), the rest along K."""
        mtw = 1 if self.r > 64 else min(2, self.mr // 16)
        wm = self.mr // 16 // mtw
        return wm, max(1, THREADS // 32 // wm)

    @property
    def chunks(self) -> int:
        wk = self.warps[1]
        return next(c for c in (4, 2, 1) if (self.ks // c) % (16 * wk) == 0)

    @property
    def name(self) -> str:
        wm, wk = self.warps
        return f"ws_r{self.r}_k{self.ks}_s{self.split}_m{self.mr}_w{wm}x{wk}_c{self.chunks}"

    @property
    def shared(self) -> int:
        stride = (self.ks + 8) * 2
        return self.r * stride + self.mr * max(stride, self.warps[1] * (self.r + 4) * 4)

    def line(self) -> str:
        wm, wk = self.warps
        return (
            f"WS_KERNEL({self.name}, {self.r}, {self.ks}, {self.split}, {self.mr}, {wm}, {wk}, {self.chunks})"
        )


def slices_for(shape: str, mr: int) -> list[Slice]:
    k = SHAPES[shape][1]
    out = []
    for r, split in CANDIDATES[shape]:
        s = Slice(r, k // split, split, mr)
        if s.shared <= 227 * 1024 and s.warps[0] * s.warps[1] * 32 <= 1024:
            out.append(s)
    return out


def build(rows: list[int]) -> CudaModule:
    mrs = sorted({mr_for(m) for m in rows})
    kernels = {s for shape in SHAPES for mr in mrs for s in slices_for(shape, mr)}
    src = source("gemm.cu") + "\n" + open(os.path.join(os.path.dirname(__file__), "gemm_ws.cu")).read() + "\n"
    src += "\n".join(s.line() for s in sorted(kernels, key=lambda s: s.name)) + "\n"
    mod = load_module(src, "gemm_ws.cu")
    for s in kernels:
        mod.allow_shared(s.name, s.shared)
    return mod


def mr_for(m: int) -> int:
    return next(mr for mr in MRS if mr >= m)


def launch(
    mod: CudaModule, s: Slice, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, add: bool, pdl: bool
):
    m = x.shape[0]
    n = w.shape[0]
    a = (
        x.data_ptr(), w.data_ptr(), out.data_ptr(), out.data_ptr() if add else 0, ctypes.c_int32(m),
        ctypes.c_int64(x.stride(0)), ctypes.c_int64(w.stride(0)), ctypes.c_int64(out.stride(0)),
        ctypes.c_int64(out.stride(0)),
    )  # fmt: skip
    wm, wk = s.warps
    grid = (n // s.r * s.split, 1, 1)
    mod.launch(
        s.name, grid, wm * wk * 32, a, torch.cuda.current_stream().cuda_stream, s.shared, programmatic=pdl
    )


def check(mod: CudaModule, m: int) -> list[dict]:
    """Every candidate of every shape against float32 sums, beside cuBLAS's error; the residual in place too."""
    dev = torch.device("cuda")
    rows = []
    for shape, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        blas = (x @ w.t()).float()
        blas_err = ((blas - ref).norm() / ref.norm()).item()
        for s in slices_for(shape, mr_for(m)):
            y = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            launch(mod, s, x, w, y, False, False)
            y2 = res.clone()
            launch(mod, s, x, w, y2, True, False)
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            ref_add = ref + res.float()
            err_add = ((y2.float() - ref_add).norm() / ref_add.norm()).item()
            ok = err <= 2 * blas_err + 1e-6 and err_add <= 2 * blas_err + 1e-6 and not y.isnan().any().item()
            rows.append({"rows": m, "shape": shape, "kernel": s.name, "err": err, "err_residual": err_add,
                         "cublas_err": blas_err, "ok": ok})  # fmt: skip
            print(f"check rows {m} {shape} {s.name}: err {err:.2e} (+res {err_add:.2e}), cuBLAS {blas_err:.2e}"
                  f" {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    return rows


def time_kinds(
    mod: CudaModule, weights: list[dict[str, torch.Tensor]], m: int
) -> tuple[dict, dict[str, Slice]]:
    """28 products of each kind alone in a graph: cuBLAS, then each candidate plainly and programmatically (us a
    product); the fastest programmatic candidate of each kind."""
    dev = torch.device("cuda")
    out: dict = {}
    best: dict[str, Slice] = {}
    for shape, (n, k) in SHAPES.items():
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]

        def blas(xs: list = xs, ys: list = ys, shape: str = shape) -> None:
            for i, lw in enumerate(weights):
                torch.mm(xs[i], lw[shape].t(), out=ys[i])

        row = {"cublas_us": graph_ms(blas) * 1000 / LAYERS}
        best_us = None
        for s in slices_for(shape, mr_for(m)):
            for pdl in (False, True):

                def ours(
                    s: Slice = s, pdl: bool = pdl, xs: list = xs, ys: list = ys, shape: str = shape
                ) -> None:
                    for i, lw in enumerate(weights):
                        launch(mod, s, xs[i], lw[shape], ys[i], False, pdl)

                us = graph_ms(ours) * 1000 / LAYERS
                row[f"{s.name}{'_pdl' if pdl else ''}_us"] = us
                if pdl and (best_us is None or us < best_us):
                    best_us, best[shape] = us, s
        out[shape] = row
        print(f"rows {m} {shape}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return out, best


def time_chain(
    mod: CudaModule, weights: list[dict[str, torch.Tensor]], m: int, plan: dict[str, Slice]
) -> dict:
    h0, h, qkv, gu = chain_buffers(m)
    own = cuda_gemm._module_or_none(0)

    def engine_chain() -> None:
        # the engine's products (the CUDA GEMM up to MINISGL_CUDA_GEMM_ROWS, launched programmatically as the
        # decode graphs' edges make it; the split-K Triton GEMM and cuBLAS above)
        plain = CudaModule.launch
        if own is not None:
            own.launch = lambda *a, **kw: plain(own, *a, **{**kw, "programmatic": True})
        try:
            for lw in weights:
                q = linear(h, lw["qkv"])
                linear_add(q[:, :2048], lw["o"], h)
                g = linear(h, lw["gate_up"])
                linear_add(g[:, :3072], lw["down"], h)
        finally:
            if own is not None:
                del own.launch

    def chain(mode: str) -> None:
        if mode == "engine":
            return engine_chain()
        for lw in weights:
            if mode == "cublas":
                cublas_layer(h, qkv, gu, lw)
            else:
                pdl = mode == "programmatic"
                launch(mod, plan["qkv"], h, lw["qkv"], qkv, False, pdl)
                launch(mod, plan["o"], qkv[:, :2048], lw["o"], h, True, pdl)
                launch(mod, plan["gate_up"], h, lw["gate_up"], gu, False, pdl)
                launch(mod, plan["down"], gu[:, :3072], lw["down"], h, True, pdl)

    plan_names = {k: s.name for k, s in plan.items()}
    modes = ("cublas", "engine", "plain", "programmatic")
    row = measure_chains(chain, modes, h, h0, {"rows": m, "plan": plan_names})
    same, rel = row["programmatic_equals_plain"], row["rel_err_vs_cublas"]
    print(
        f"chain rows {m:4d}: cuBLAS {row['cublas_ms']:.3f} ms, engine {row['engine_ms']:.3f}, slices "
        f"{row['plain_ms']:.3f}, programmatic {row['programmatic_ms']:.3f} (bits equal to plain: {same}; "
        f"against cuBLAS {rel:.1e})",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    mod = build(rows_list)
    dev = torch.device("cuda")
    weights = [
        {
            k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * (0.5 * kk**-0.5)
            for k, (n, kk) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]
    result: dict = {"checks": [], "kinds": {}, "chains": []}
    for m in rows_list:
        result["checks"] += check(mod, m)
    for m in rows_list:
        kinds, plan = time_kinds(mod, weights, m)
        result["kinds"][m] = kinds
        result["chains"].append(time_chain(mod, weights, m, plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
