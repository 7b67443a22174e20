"""A decode step's GEMMs on CUDA under each of torch's BLAS settings: which library, and whether the sums of
split-K may be reduced in bf16.

    python benchmark/offline/blas_choice.py [--models qwen3-0.6b] [--rows 1,8,32,64,128,256] [--json out.json]

The layers' F.linear goes to cuBLAS by default; `torch.backends.cuda.preferred_blas_library("cublaslt")`
sends it through cuBLASLt, whose heuristic sees the 32 MiB workspace torch gives Hopper and may pick other
kernels (split-K, stream-K) for the few rows of a decode step. `allow_bf16_reduced_precision_reduction`
lets cuBLAS reduce split-K partial sums in bf16, which it otherwise avoids for bf16 products. For each
setting and number of rows: every layer's q|k|v, o, gate|up and down projections, each layer its own
weights, captured in one CUDA graph (skinny_gemm.py's `graph_ms`), shape by shape and the whole step; each
setting's products are checked against the default's before they are timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import MODELS, graph_ms  # noqa: E402

SETTINGS = {
    "cublas": ("cublas", False),
    "cublas+bf16_reduce": ("cublas", True),
    "cublaslt": ("cublaslt", False),
    "cublaslt+bf16_reduce": ("cublaslt", True),
}


def apply(setting: str) -> None:
    library, reduce = SETTINGS[setting]
    torch.backends.cuda.preferred_blas_library(library)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduce


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,8,32,64,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    default_reduce = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    print(f"torch {torch.__version__}; bf16 reduced-precision reduction by default: {default_reduce}")
    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        layers, shapes = MODELS[model]
        weights = [
            [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k**-0.5 for _ in range(layers)]
            for n, k in shapes
        ]
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _, k in shapes]
            apply("cublas")
            refs = [F.linear(x, w[0]).float() for x, w in zip(xs, weights)]
            line = []
            for setting in SETTINGS:
                apply(setting)
                diff = max(
                    ((F.linear(x, w[0]).float() - r).abs().max() / r.abs().max()).item()
                    for x, w, r in zip(xs, weights, refs)
                )
                per_shape = []
                for x, ws in zip(xs, weights):
                    per_shape.append(graph_ms(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]) * 1e3 / layers)
                step = graph_ms(
                    lambda xs=xs, weights=weights, layers=layers: [
                        F.linear(x, w[i]) for i in range(layers) for x, w in zip(xs, weights)
                    ]
                )
                row = {"model": model, "rows": m, "setting": setting, "step_ms": step,
                       "us_per_gemm": dict(zip(("qkv", "o", "gate_up", "down"), per_shape)),
                       "rel_diff": diff}  # fmt: skip
                results.append(row)
                line.append(f"{setting} {step:.3f} ms ({' / '.join(f'{u:.1f}' for u in per_shape)} us)")
            apply("cublas")
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = default_reduce
            print(f"{model} rows={m}: " + "; ".join(line), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
