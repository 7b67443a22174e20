"""FP8 decode attention on the tensor cores (minisgl/kernel/cuda/decode_tc.cu) against the CUDA-core kernel
(minisgl/kernel/cuda/decode.cu) and the Triton kernel, each alone, on the workload's contexts halfway.

    python benchmark/offline/decode_tc.py [--batches 16,64,128,256] [--groups 2,4] [--json out.json]
    python benchmark/offline/decode_tc.py --compile-only [--arch sm_90]   # any machine with libnvrtc
    python benchmark/offline/decode_tc.py --emulate   # the fragment layouts, lane by lane, on the CPU

Why (docs/benchmarks.md, "Decode attention in CUDA C++"): the CUDA-core kernel reads the FP8 rows at 3.5 TB/s,
with about 37 warp instructions a key and KV head (each thread widens its bytes to float32 and multiplies
them in); with 4 query heads a KV head it needs 239-255 registers and loses to Triton. Here each 16-key tile
costs 16 mma and about 160 instructions a thread (10 warp instructions a key), whatever the query heads a KV
head up to 8. Before any timing, every output is checked against a float64 reference on small cases (1, 3, 16
splits; contexts shorter than a tile, empty splits) and against the Triton kernel on each timed batch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "minisgl", "kernel", "cuda", "decode_tc.cu"
)
HK = 8
# the variants timed and compiled: the engine's (TC_VARIANTS) unless --variants names others
VARIANTS: tuple[tuple[int, ...], ...] = ()
FP8 = True  # the pool: --pool


def variants() -> tuple[tuple[int, ...], ...]:
    from minisgl.kernel.cuda.decode import TC_BF16_VARIANTS, TC_VARIANTS

    return VARIANTS or (TC_VARIANTS if FP8 else TC_BF16_VARIANTS)


def tc_program() -> str:
    """decode_tc.cu with every variant timed, for each query group."""
    from minisgl.kernel.cuda.decode import tc_program

    return tc_program(variants(), fp8=FP8)  # type: ignore[arg-type]


def compile_only(arch: str) -> None:
    from minisgl.kernel.cuda import compile_cubin

    _, log = compile_cubin(tc_program(), arch, ["--ptxas-options=-v"], "decode_tc.cu")
    for block in log.split("Compiling entry function '")[1:]:
        regs = re.search(r"Used (\d+) registers", block)
        spills = re.search(r"(\d+) bytes spill stores", block)
        print(f"{block.split(chr(39))[0]:<20} {regs.group(1) if regs else '?':>4} registers, "
              f"{spills.group(1) if spills else '?'} bytes spilled")  # fmt: skip


def _mma(a: list[list[float]], b: list[list[float]], c: list[list[float]]) -> list[list[float]]:
    """mma.sync m16n8k16 by the PTX ISA's fragment layouts: a[lane] holds a0..a7, b[lane] b0..b3, c[lane] c0..c3."""
    import numpy as np

    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):
            A[g + 8 * (i in (2, 3, 6, 7)), 2 * t + (i & 1) + 8 * (i >= 4)] = a[lane][i]
        for i in range(4):
            B[2 * t + (i & 1) + 8 * (i >= 2), g] = b[lane][i]
            C[g + 8 * (i >= 2), 2 * t + (i & 1)] = c[lane][i]
    out = A @ B + C
    return [[out[lane // 4 + 8 * (i >= 2), 2 * (lane % 4) + (i & 1)] for i in range(4)] for lane in range(32)]


def dim_of(g: int, i: int, fp8: bool) -> int:
    """decode_tc.cu's dim_of: the output dim of row g of O^T's chunk i (row g + 8: the dim after it)."""
    return 16 * g + 2 * i if fp8 else 8 * g + 2 * (i % 4) + 64 * (i // 4)


def emulate(n_keys: int, group: int, seed: int = 0, fp8: bool = True) -> float:
    """decode_tc.cu's fragment arithmetic for one warp, lane by lane in float64 (its index formulas written
    out again, the mma from the PTX layouts), against plain attention: the largest absolute difference. A
    check of the layouts on any machine, for the FP8 pool's or the bf16 pool's V dims; rounding is not
    emulated."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, tile = 128, 16
    k, v = rng.standard_normal((n_keys, d)), rng.standard_normal((n_keys, d))
    q = np.zeros((8, d))
    q[:group] = rng.standard_normal((group, d)) * 0.3
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    m = [[-np.inf, -np.inf] for _ in lanes]
    l_part = [[0.0, 0.0] for _ in lanes]
    acc = [[[0.0] * 4 for _ in range(8)] for _ in lanes]

    def row(x: Any, key: int) -> Any:  # keys past the end read the pool's zeros (the engine's pool is zeroed)
        return x[key] if key < n_keys else np.zeros(d)

    for kb0 in range(0, n_keys, tile):
        sc = [[0.0] * 4 for _ in lanes]
        for j in range(8):  # S = K Q^T, chunk j: thread t's dims 32t + 4j .. 32t + 4j + 3
            a, b = [], []
            for g, t in lanes:
                at = 32 * t + 4 * j
                ka, kb = row(k, kb0 + g)[at : at + 4], row(k, kb0 + g + 8)[at : at + 4]
                a.append([ka[0], ka[1], kb[0], kb[1], ka[2], ka[3], kb[2], kb[3]])
                b.append(list(q[g, at : at + 4]))
            sc = _mma(a, b, sc)
        p = [[0.0] * 4 for _ in lanes]
        for lane, (g, _) in enumerate(lanes):
            for e in range(4):
                if kb0 + g + 8 * (e >= 2) >= n_keys:
                    sc[lane][e] = -np.inf
        for lane, (_, t) in enumerate(lanes):
            same = [4 * x + t for x in range(8)]  # the lanes a shuffle over xor 4, 8, 16 reaches
            for c in range(2):
                mx = max(max(sc[x][c], sc[x][c + 2]) for x in same)
                mn = max(m[lane][c], mx)
                ref = 0.0 if mn == -np.inf else mn
                alpha = 2.0 ** (m[lane][c] - ref)
                m[lane][c] = mn
                p[lane][c], p[lane][c + 2] = 2.0 ** (sc[lane][c] - ref), 2.0 ** (sc[lane][c + 2] - ref)
                l_part[lane][c] = l_part[lane][c] * alpha + p[lane][c] + p[lane][c + 2]
                for i in range(8):
                    acc[lane][i][c] *= alpha
                    acc[lane][i][c + 2] *= alpha
        # P^T as B: from lanes 8t + g / 2 and 8t + 4 + g / 2, half g % 2 of (p0, p1) and of (p2, p3)
        pb = []
        for g, t in lanes:
            s0, s1, h = 8 * t + g // 2, 8 * t + 4 + g // 2, g & 1
            pb.append([p[s0][h], p[s1][h], p[s0][2 + h], p[s1][2 + h]])
        for i in range(8):  # O^T += V^T P^T, chunk i: rows g, g + 8 are dims dim_of(g, i) and the one after
            a = []
            for g, t in lanes:
                v0, v1, v2, v3 = (row(v, kb0 + r) for r in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9))
                dd = dim_of(g, i, fp8)
                a.append([v0[dd], v1[dd], v0[dd + 1], v1[dd + 1],
                          v2[dd], v3[dd], v2[dd + 1], v3[dd + 1]])  # fmt: skip
            res = _mma(a, pb, [acc[lane][i] for lane in range(32)])
            for lane in range(32):
                acc[lane][i] = res[lane]
    out = np.zeros((group, d))
    for lane, (g, t) in enumerate(lanes):
        for c in range(2):
            if 2 * t + c < group:
                total = sum(l_part[4 * x + t][c] for x in range(8))
                for i in range(8):
                    out[2 * t + c, dim_of(g, i, fp8)] = acc[lane][i][c] / total
                    out[2 * t + c, dim_of(g, i, fp8) + 1] = acc[lane][i][c + 2] / total
    s = q[:group] @ k.T
    w = 2.0 ** (s - s.max(1, keepdims=True))
    return float(np.abs(out - (w / w.sum(1, keepdims=True)) @ v).max())


def tensor_core_kernels() -> Any:
    """The engine's launcher of decode_tc.cu (the same arguments, grid and merge as decode.cu's)."""
    from minisgl.kernel.cuda.decode import TensorCoreDecode

    return TensorCoreDecode(variants=variants(), groups=TensorCoreDecode.GROUPS, fp8=FP8)  # type: ignore[arg-type]


def check_reference(tc: Any) -> float:
    """The largest relative error against a float64 reference over small cases, every variant; raises past 8e-3."""
    from test_cuda_decode import reference_case
    from test_triton_kernels import rel_err

    worst = 0.0
    for group in (1, 2, 4, 8):
        for splits in (1, 3, 16):
            c = reference_case([1, 5, 37, 300, 129, 1000, 64, 16], group, group + splits, FP8)
            for variant in tc.variants:
                out = tc(*c.args(splits), None, variant)
                err = rel_err(out.float().cpu(), c.ref)
                print(
                    f"reference check G={group} splits={splits} variant {variant}: relative error {err:.2e}"
                )
                worst = max(worst, err)
    if worst >= 8e-3:
        raise SystemExit(
            f"the tensor-core kernel is off the reference (relative error {worst:.2e}): no timing"
        )
    return worst


def run_batch(
    tc: Any,
    cores: Any,
    bs: int,
    group: int,
    layout: str = "engine",
    d: int = 128,
    more_splits: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Every kernel on the workload's contexts halfway; `layout` is kv_layout.py's slot layout, with ":hm" a
    head-major pool (a head's slots side by side, seen through a transpose); `more_splits`: the tensor-core
    kernels also with these split counts (the merge kernel's launch included), besides the engine's."""
    from kv_layout import decode_case, graph_us

    from minisgl.kernel import attention as attn

    slots, _, pool = layout.partition(":")
    c = decode_case(bs, slots, FP8, head_major=pool == "hm", hq=group * HK, hk=HK)
    order = c.order()
    splits = attn.decode_splits(bs, HK)
    args = (c.q, c.k, c.v, c.table, c.rows, c.seq, splits, d**-0.5, *c.scales)

    def triton() -> Any:
        return attn.decode_attention(*args, None, order)

    ref = triton().float()
    runs = {"triton": triton}
    for variant in tc.variants:
        runs[f"tc {','.join(map(str, variant))}"] = lambda variant=variant: tc(*args, order, variant)
    for n in more_splits:
        if n != splits:
            other = (*args[:6], n, *args[7:])
            for variant in tc.variants:
                name = f"tc {','.join(map(str, variant))} /{n}"
                runs[name] = lambda variant=variant, other=other: tc(*other, order, variant)
    if cores is not None and group in cores.groups:
        runs["CUDA cores"] = lambda: cores(*args, order=order)
    rows = []
    for name, fn in runs.items():
        diff = (fn().float() - ref).abs().max().item()
        us = graph_us(fn)
        rows.append(
            dict(
                bs=bs,
                group=group,
                layout=layout,
                kernel=name,
                splits=int(name.rsplit("/", 1)[1]) if "/" in name else splits,
                us=us,
                tb_s=c.kv_bytes / us / 1e6,
                max_diff=diff,
            )
        )
        print(f"G={group} bs={bs:3d} {layout:>14} {name:>12}: {us:7.1f} us ({c.kv_bytes / us / 1e6:.2f} TB/s), "
              f"max diff against Triton {diff:.2e}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="16,64,128,256")
    p.add_argument("--groups", default="2,4", help="query heads a KV head (8 KV heads)")
    p.add_argument("--json", default=None)
    p.add_argument("--pool", choices=("fp8", "bf16"), default="fp8", help="the KV pool's dtype")
    p.add_argument(
        "--layouts",
        default="engine",
        help="slot layouts of kv_layout.py (engine, contiguous, random, pages), ':hm' for a head-major pool",
    )
    p.add_argument(
        "--splits", default="", help="split counts to time the tensor-core kernels at besides the engine's"
    )
    p.add_argument("--compile-only", action="store_true", help="compile with NVRTC and print ptxas's report")
    p.add_argument("--arch", default="sm_90", help="--compile-only's target")
    p.add_argument("--emulate", action="store_true", help="check the fragment layouts on the CPU (emulate())")
    p.add_argument(
        "--variants",
        default="",
        help="decode_tc.cu variants to time, 'STAGES,MIN_BLOCKS[,WIDEN,JIT];...' (default: the engine's)",
    )
    args = p.parse_args()
    global VARIANTS, FP8
    FP8 = args.pool == "fp8"
    VARIANTS = tuple(tuple(int(x) for x in v.split(",")) for v in args.variants.split(";") if v)
    if args.compile_only:
        compile_only(args.arch)
        return
    if args.emulate:
        for n_keys, group in ((45, 2), (16, 1), (33, 4), (64, 8), (5, 2)):
            err = emulate(n_keys, group, fp8=FP8)
            print(f"emulated one warp, {n_keys} keys, {group} query heads: max difference {err:.1e}")
            if err > 1e-9:
                raise SystemExit("the fragment layouts do not give attention")
        return
    from minisgl.kernel.cuda.decode import CudaDecode

    tc = tensor_core_kernels()
    worst = check_reference(tc)
    cores = CudaDecode(FP8)
    results: list[dict[str, Any]] = [dict(reference_rel_err=worst)]
    for group in (int(g) for g in args.groups.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            for layout in args.layouts.split(","):
                more = tuple(int(n) for n in args.splits.split(",") if n)
                results += run_batch(tc, cores, bs, group, layout, more_splits=more)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
