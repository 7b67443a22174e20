"""The decode kernel at batch 256 (the upstream workload's contexts halfway), once per variant, for Nsight Compute.

    ncu --clock-control none -k regex:_decode_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats python benchmark/offline/decode_ncu.py
    ncu --clock-control none -k regex:decode_ --launch-skip 2 --launch-count 2 ... \\
        python benchmark/offline/decode_ncu.py --cuda      # the CUDA C++ kernel (minisgl/kernel/cuda/decode.cu)
    ncu ... -k regex:decode_tc python benchmark/offline/decode_ncu.py --tc   # decode_tc.cu, FP8, each variant

Two pools, each launched once to compile and once to be profiled, in this order: bf16, then FP8, each with the
engine's choice of tiles (or of the CUDA kernel's variant).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", help="the CUDA C++ kernel instead of the Triton one")
    p.add_argument("--tc", action="store_true", help="decode_tc.cu's variants (TC_VARIANTS) on the FP8 pool")
    args = p.parse_args()
    from decode_variants import scattered_batch

    from minisgl.kernel import attention as attn
    from minisgl.kernel.cuda.decode import TC_VARIANTS, CudaDecode, TensorCoreDecode

    bs, hq, hk, d = 256, 16, 8, 128
    lens, table, rows, seq = scattered_batch(bs)
    total = sum(lens)
    q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(total + 64, hk, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    variants = [("bf16", (k, v), ()), ("fp8", (k8, v8), scales)]
    decode = attn.decode_attention
    if args.cuda:
        kernels = {False: CudaDecode(False), True: CudaDecode(True)}

        def decode(q, kc, *rest):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            return kernels[kc.dtype == torch.float8_e4m3fn](q, kc, *rest)

    profiled: list[str] = []
    if args.tc:  # each variant once to load, then once to be profiled, in TC_VARIANTS' order
        tc = TensorCoreDecode(variants=TC_VARIANTS)
        variants = [(f"tc {v}", (k8, v8), scales) for v in TC_VARIANTS]

        def decode(q, kc, vc, *rest):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            return tc(q, kc, vc, *rest, None, TC_VARIANTS[len(profiled) % len(TC_VARIANTS)])

    for _, (kc, vc), sc in variants:  # compile each, outside the profiled launches
        decode(q, kc, vc, table, rows, seq, 1, d**-0.5, *sc)
    torch.cuda.synchronize()
    for name, (kc, vc), sc in variants:
        decode(q, kc, vc, table, rows, seq, 1, d**-0.5, *sc)
        torch.cuda.synchronize()
        profiled.append(name)
        print("profiled", name, flush=True)


if __name__ == "__main__":
    main()
