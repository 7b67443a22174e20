"""Decode GEMMs by gemm.cu's kernel (tokens the tensor cores' narrow side, K split over a cluster) against cuBLAS.

    python benchmark/offline/gemm_cuda.py [--models qwen3-0.6b] [--rows 1,8,16,32,64,128,192,256]
        [--stages 3,4] [--json out.json]

Every projection of a model shape (q|k|v, o, gate|up, down; o and down add the residual in place, as the
engine's `linear_add` does), each layer its own weights so that none stays in L2, its layers' products in one
CUDA graph: cuBLAS (torch's mm / addmm_), the rule's configuration (`gemm.choose_config`) and every tile, split
and stage count around it. Every output is first checked against a float32 product (the error at most twice
cuBLAS's, plus bf16's rounding of the output). Prints us a GEMM and a step's products by each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import MODELS, graph_ms  # noqa: E402

from minisgl.kernel.cuda import gemm  # noqa: E402

ADDS = (False, True, False, True)  # o and down add the residual


def candidates(m: int, n: int, k: int, sms: int, stages: list[int]) -> list[gemm.GemmConfig]:
    rule = gemm.choose_config(m, n, k, sms)
    bms = {gemm.token_block(m)} | ({64} if m > 64 else set())
    out = [rule]
    for bn in (64, 128):
        for bm in sorted(bms):
            for split in (1, 2, 4, 8):
                for st in stages:
                    c = gemm.config(bn, bm, split, st)
                    if c.fits(n, k) and c not in out:
                        out.append(c)
    return out


def time_shape(
    kernel: gemm.CudaGemm, configs: list[gemm.GemmConfig], layers: int, m: int, n: int, k: int, add: bool
) -> dict:
    """us a GEMM by cuBLAS and by each configuration (the first the rule's), every output checked first."""
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    res0 = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().t() + (res0.float() if add else 0)
    res = res0.clone()
    got = res.addmm_(x, ws[0].t()) if add else torch.mm(x, ws[0].t())
    blas_err = (got.float() - ref).abs().max().item()
    tol = 2 * blas_err + 1e-6

    def blas() -> None:
        for w in ws:
            if add:
                res.addmm_(x, w.t())
            else:
                torch.mm(x, w.t())

    row = {"rows": m, "n": n, "k": k, "cublas_us": graph_ms(blas) * 1e3 / layers, "cublas_err": blas_err}
    timed = []
    for c in configs:
        res.copy_(res0)
        out = kernel(x, ws[0], c, residual=res if add else None, out=res if add else None)
        err = (out.float() - ref).abs().max().item()
        if not err <= tol:  # reported, not timed; the run goes on to the other configurations
            print(f"WRONG {m}x{n}x{k} {c.name}: error {err:.3g} > {tol:.3g} (cuBLAS {blas_err:.3g})", flush=True)
            row.setdefault("wrong", {})[c.name] = err
            timed.append((float("inf"), c))
            continue

        def ours(c: gemm.GemmConfig = c) -> None:
            for w in ws:
                kernel(x, w, c, residual=res if add else None, out=res if add else None)

        timed.append((graph_ms(ours) * 1e3 / layers, c))
    best_us, best = min(timed, key=lambda t: t[0])
    row.update(rule=configs[0].name, rule_us=timed[0][0], best=best.name, best_us=best_us)
    row["all"] = {c.name: us for us, c in timed}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,8,16,32,64,128,192,256")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [int(r) for r in args.rows.split(",")]
    stages = [int(s) for s in args.stages.split(",")]

    plans = {}
    for model in args.models.split(","):
        layers, shapes = MODELS[model]
        for m in rows:
            for n, k in shapes:
                plans[(model, m, n, k)] = candidates(m, n, k, sms, stages)
    configs = tuple({c for cs in plans.values() for c in cs})
    print(f"compiling {len(configs)} kernels", flush=True)
    kernel = gemm.CudaGemm(configs)

    results = []
    for model in args.models.split(","):
        layers, shapes = MODELS[model]
        for m in rows:
            step = {"cublas": 0.0, "rule": 0.0, "best": 0.0}
            for (n, k), add in zip(shapes, ADDS):
                row = time_shape(kernel, plans[(model, m, n, k)], layers, m, n, k, add)
                row["model"] = model
                results.append(row)
                us_blas, rule_us, best_us = row["cublas_us"], row["rule_us"], row["best_us"]
                step["cublas"] += us_blas * layers / 1e3
                step["rule"] += rule_us * layers / 1e3
                step["best"] += best_us * layers / 1e3
                print(
                    f"{model} rows {m:4d} {n:6d}x{k:6d}: cuBLAS {us_blas:6.2f} us, rule {rule_us:6.2f} "
                    f"({row['rule']}), best {best_us:6.2f} ({row['best']})",
                    flush=True,
                )
            print(
                f"{model} rows {m:4d}: a step's products cuBLAS {step['cublas']:.3f} ms, rule {step['rule']:.3f}, "
                f"best {step['best']:.3f}",
                flush=True,
            )
            results.append({"model": model, "rows": m, "step_ms": step})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
