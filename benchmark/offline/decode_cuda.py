"""Decode attention by the CUDA C++ kernel (minisgl/kernel/cuda/decode.cu) against the engine's Triton kernel,
each alone, on the workload's contexts halfway through their outputs: every variant (keys a thread group loads
a step, threads a key) at the engine's split count, one split and two, both pools, for 2 and 4 query heads a
KV head (the Qwen3-0.6B shape's 16 / 8, the Llama-3-8B shape's 32 / 8).

    python benchmark/offline/decode_cuda.py [--batches 8,16,32,64,128,256] [--groups 2,4] [--json out.json]
    python benchmark/offline/decode_cuda.py --compile-only [--arch sm_90]   # any machine with libnvrtc

Why the kernel is written in CUDA C++ (docs/benchmarks.md, "Decode attention in CUDA C++"): the Triton FP8
kernel reads its rows at what a bare gather of them reads, 2.7-2.9 TB/s, because Triton pipelines through shared
memory only tiles that feed the dot as loaded, and the P x V product wants V's keys side by side, a layout
change byte by byte. On the CUDA cores neither is needed: each thread's bytes of a K or V row are one load,
widened in registers and multiplied into its own dims. Every output is checked against Triton's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (keys a thread group loads a step, threads a key); 4 query heads a KV head only with 16 threads a key (8 keep
# 239-255 registers a thread)
SWEEP = ((2, 8), (4, 8), (1, 16), (2, 16), (4, 16))
GROUPS = (1, 2, 4)
HK = 8


def compile_only(arch: str) -> None:
    import re

    from minisgl.kernel.cuda import compile_cubin
    from minisgl.kernel.cuda.decode import program

    _, log = compile_cubin(program((True, False), SWEEP, GROUPS), arch, ["--ptxas-options=-v"], "decode.cu")
    for block in log.split("Compiling entry function '")[1:]:
        regs = re.search(r"Used (\d+) registers", block)
        spills = re.search(r"(\d+) bytes spill stores", block)
        print(f"{block.split(chr(39))[0]:<24} {regs.group(1) if regs else '?':>4} registers, "
              f"{spills.group(1) if spills else '?'} bytes spilled")  # fmt: skip


def run_batch(kernels: Any, bs: int, fp8: bool, group: int, d: int = 128) -> list[dict[str, Any]]:
    from kv_layout import decode_case, graph_us

    from minisgl.kernel import attention as attn

    c = decode_case(bs, "engine", fp8, hq=group * HK, hk=HK)
    order = c.order()
    rows: list[dict[str, Any]] = []
    base = dict(bs=bs, fp8=fp8, group=group)
    for splits in sorted({attn.decode_splits(bs, HK), 1, 2}):
        engine_splits = splits == attn.decode_splits(bs, HK)

        def triton(s: int = splits) -> Any:
            return attn.decode_attention(
                c.q, c.k, c.v, c.table, c.rows, c.seq, s, d**-0.5, *c.scales, None, order
            )

        ref = triton().float()
        rows.append(
            base | dict(kernel="triton", splits=splits, engine_splits=engine_splits, us=graph_us(triton))
        )
        for variant in SWEEP:
            if group == 4 and variant[1] == 8:
                continue

            def cuda(v: tuple[int, int] = variant, s: int = splits) -> Any:
                return kernels(c.q, c.k, c.v, c.table, c.rows, c.seq, s, d**-0.5, *c.scales, order, v)

            diff = (cuda().float() - ref).abs().max().item()
            rows.append(
                base | dict(kernel=f"cuda {variant[0]},{variant[1]}", splits=splits, engine_splits=engine_splits,
                            us=graph_us(cuda), max_diff=diff)
            )  # fmt: skip
    for r in rows:
        r["tb_s"] = c.kv_bytes / r["us"] / 1e6
        print(
            f"G={group} bs={bs:3d} {'fp8 ' if fp8 else 'bf16'} {r['kernel']:>10} splits={r['splits']:2d}: "
            f"{r['us']:7.1f} us ({r['tb_s']:.2f} TB/s)"
            + (f", max diff against Triton {r['max_diff']:.2e}" if "max_diff" in r else ""),
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,16,32,64,128,256")
    p.add_argument("--groups", default="2,4", help="query heads a KV head (8 KV heads)")
    p.add_argument("--json", default=None)
    p.add_argument("--compile-only", action="store_true", help="compile with NVRTC and print ptxas's report")
    p.add_argument("--arch", default="sm_90", help="--compile-only's target")
    args = p.parse_args()
    if args.compile_only:
        compile_only(args.arch)
        return
    from minisgl.kernel.cuda.decode import CudaDecode

    kernels = {fp8: CudaDecode(fp8, variants=SWEEP, groups=GROUPS) for fp8 in (True, False)}
    results = []
    for group in (int(g) for g in args.groups.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            for fp8 in (True, False):
                results += run_batch(kernels[fp8], bs, fp8, group)
    # the fastest kernel at the engine's split count, per group, pool and batch
    print("fastest at the engine's splits (us): group pool batch: triton / best CUDA variant")
    for group in sorted({r["group"] for r in results}):
        for fp8 in (True, False):
            for bs in sorted({r["bs"] for r in results}):
                mine = [
                    r
                    for r in results
                    if (r["group"], r["fp8"], r["bs"]) == (group, fp8, bs) and r["engine_splits"]
                ]
                tri = next(r for r in mine if r["kernel"] == "triton")
                best = min((r for r in mine if r["kernel"] != "triton"), key=lambda r: r["us"])
                print(f"  G={group} {'fp8 ' if fp8 else 'bf16'} bs={bs:3d}: {tri['us']:7.1f} / {best['us']:7.1f} "
                      f"({best['kernel']}, {tri['us'] / best['us']:.2f}x)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
