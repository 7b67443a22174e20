#!/usr/bin/env bash
# Two measurements of the Llama-3-8B workload's distance from its floor, on one GPU in one call of about
# eight minutes: the decode GEMMs of 1-16 rows, cuBLAS against split-K with more programs and a kernel on
# the CUDA cores (gemv_variants.py), and one prefill step and one decode step kernel by kernel
# (kernel_profile.py), with cuBLAS's rate on the prefill step's GEMM shapes. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 240 python benchmark/offline/gemv_variants.py --json "$OUT/gemv_variants.json" 2>&1 | tail -45
timeout 60 python - <<'PY' 2>&1 | tee "$OUT/prefill_gemm.txt"
import torch, torch.nn.functional as F
for m in (8192, 16384):
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            F.linear(x, w)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            F.linear(x, w)
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e) / 20
        print(f"prefill GEMM M={m} {n}x{k}: {ms:.3f} ms, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s")
PY
[ -d /tmp/ckpt/llama3-8b ] || python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b > /dev/null 2>&1
timeout 200 python benchmark/offline/kernel_profile.py --model /tmp/ckpt/llama3-8b --json "$OUT/kernels_llama3.json" \
    2>&1 | grep -A16 "step, batch"
