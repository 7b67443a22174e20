"""cuBLASLt's candidate algorithms for a decode step's products, each timed, against torch's choice.

    python benchmark/offline/lt_algos.py [--model qwen3-0.6b] [--rows 16,64,128,256] [--algos 24] [--json out.json]

torch asks cuBLAS (or cuBLASLt) for its first heuristic choice; "Decode GEMMs of few rows" found every library
setting picking kernels of 5.4-8.4 us for products that read 4-12 MB (docs/benchmarks.md). Here cuBLASLt's heuristic
is asked for up to --algos candidates for each product of the model's layers at each row count, and every candidate
is timed as the step runs it: each layer its own weights (so none stays in L2), the layers' products of that shape
one after another in a CUDA graph. A candidate is checked against torch's product first (same sums up to bf16
rounding). Prints, by shape and rows, torch's time, the heuristic's first, and the fastest candidate's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import MODELS, graph_ms  # noqa: E402

_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_R_32F, _R_16BF = 0, 14  # cudaDataType
_TRANSA, _TRANSB = 3, 4  # CUBLASLT_MATMUL_DESC_TRANSA / _TRANSB
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE = 1  # CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
WORKSPACE = 32 << 20


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 bytes), its workspace, status, waves, reserved."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_lt() -> ctypes.CDLL:
    """The cuBLASLt that torch loaded (found in the process's mappings once torch has run a product)."""
    a = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise SystemExit("cuBLASLt is not loaded in this process")


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: cuBLAS status {rc}")


class LtProduct:
    """y [M, N] = x [M, K] @ w [N, K]^T (+ y where `accumulate`) through cuBLASLt, bf16 in and out, float32 sums."""

    def __init__(
        self, lt: ctypes.CDLL, handle: ctypes.c_void_p, m: int, n: int, k: int, accumulate: bool
    ) -> None:
        self.lt, self.handle = lt, handle
        self.desc = ctypes.c_void_p()
        _ok(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, op in ((_TRANSA, _OP_T), (_TRANSB, _OP_N)):
            v = ctypes.c_int32(op)
            _ok(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        # column-major: C [N, M] = op(A) [N, K] op(B) [K, M], A = w as [K, N] (ld K), B = x as [K, M] (ld K)
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for lay, (r, c_, ld) in zip((self.a, self.b, self.c), ((k, n, k), (k, m, k), (n, m, n))):
            _ok(
                lt.cublasLtMatrixLayoutCreate(
                    ctypes.byref(lay), _R_16BF, ctypes.c_uint64(r), ctypes.c_uint64(c_), ctypes.c_int64(ld)
                ),
                "MatrixLayoutCreate",
            )
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def candidates(self, count: int) -> list[HeuristicResult]:
        pref = ctypes.c_void_p()
        _ok(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE)
        _ok(
            self.lt.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
            "PreferenceSetAttribute",
        )
        results = (HeuristicResult * count)()
        got = ctypes.c_int()
        _ok(
            self.lt.cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                self.a,
                self.b,
                self.c,
                self.c,
                pref,
                count,
                results,
                ctypes.byref(got),
            ),
            "AlgoGetHeuristic",
        )
        self.lt.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, algo: HeuristicResult) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _ok(
            self.lt.cublasLtMatmul(
                self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
                ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()),
                self.c, ctypes.c_void_p(y.data_ptr()), self.c, ctypes.byref(algo.algo),
                ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream,
            ),
            "Matmul",
        )  # fmt: skip


def run_shape(
    lt: ctypes.CDLL, handle: ctypes.c_void_p, layers: int, n: int, k: int, m: int, count: int
) -> dict[str, Any]:
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ ws[0].float().t()).bfloat16()

    def torch_step() -> None:
        for w in ws:
            torch.mm(x, w.t(), out=y)

    row: dict[str, Any] = {"n": n, "k": k, "rows": m, "torch_us": graph_ms(torch_step) * 1e3 / layers}
    prod = LtProduct(lt, handle, m, n, k, accumulate=False)
    timed = []
    for i, cand in enumerate(prod.candidates(count)):
        try:
            y.zero_()
            prod(x, ws[0], y, cand)
            torch.cuda.synchronize()
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                timed.append({"index": i, "error": err})
                continue

            def lt_step(cand: HeuristicResult = cand) -> None:
                for w in ws:
                    prod(x, w, y, cand)

            timed.append({"index": i, "us": graph_ms(lt_step) * 1e3 / layers, "error": err,
                          "workspace": cand.workspace, "waves": cand.waves})  # fmt: skip
        except RuntimeError as e:
            timed.append({"index": i, "failed": str(e)})
    ok = [t for t in timed if "us" in t]
    row["candidates"] = timed
    if ok:
        row["first_us"] = next((t["us"] for t in ok if t["index"] == 0), None)
        best = min(ok, key=lambda t: t["us"])
        row["best_us"], row["best_index"] = best["us"], best["index"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--rows", default="16,64,128,256")
    ap.add_argument("--algos", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lt = load_lt()
    handle = ctypes.c_void_p()
    _ok(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    layers, shapes = MODELS[args.model]
    out = []
    for m in (int(r) for r in args.rows.split(",")):
        for n, k in shapes:
            row = run_shape(lt, handle, layers, n, k, m, args.algos)
            out.append(row)
            print(f"rows {m:4d} {n:6d} x {k:5d}: torch {row['torch_us']:6.2f} us, heuristic's first "
                  f"{row.get('first_us') or float('nan'):6.2f}, best {row.get('best_us', float('nan')):6.2f} "
                  f"(candidate {row.get('best_index')} of {len(row['candidates'])})", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
