"""Decode attention's splits along the sequence, or its registers a thread, against the engine's choice, on
one GPU, bf16 and FP8 pools, every figure from CUDA-graph replays.

    python benchmark/offline/decode_splits.py [--batches 16,32,64,128,256] [--json out.json]
    python benchmark/offline/decode_splits.py --sweep regs [--batches 64,128,256] [--json out.json]
    python benchmark/offline/decode_splits.py --sweep order [--json out.json]

The engine splits a request's context into `decode_splits(bs, kv_heads)` parts only while the batch's
programs alone do not reach TARGET_PROGRAMS (about two an SM). With the workload's uneven contexts (a
prompt of 100-1,024 tokens plus half its output) whole contexts make programs of very different lengths,
and at three programs an SM the last wave is the long requests' alone. Here each split count is timed on
the workload's contexts halfway (roofline.py's mid_run_contexts, slots scattered), ten launches captured
in one CUDA graph so that the host's launch time is not in the figure, the merge kernel included.

`--sweep regs` times tiles with the registers a thread capped (ptxas's .maxnreg, DecodeConfig.maxnreg),
which set how many programs an SM holds: on an FP8 pool the 128-key tile takes 177 registers uncapped, two
programs of four warps an SM, 168 lets three fit, 128 four (with a few bytes of stack). The programs start
in the engine's order (longest first from MINISGL_DECODE_LONGEST_FIRST rows). Each configuration's output is
compared with the engine's choice before it is timed.

`--sweep order` times 1, 2 and 4 splits and the engine's count with the requests' programs in batch order
and longest context first (`decode_order`, MINISGL_DECODE_LONGEST_FIRST); the ordered outputs must be
the unordered ones bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from minisgl.env import ENV  # noqa: E402
from minisgl.kernel import attention as attn  # noqa: E402

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
LAUNCHES = 10  # a graph replay's launches: each replay's time over this is one launch's device time


def graph_us(fn: Any) -> float:
    """Device time of one fn(), from replays of a graph of LAUNCHES calls."""
    from skinny_gemm import graph_ms

    return graph_ms(lambda: [fn() for _ in range(LAUNCHES)]) * 1e3 / LAUNCHES


# (keys a tile, warps, stages, unmasked full tiles, registers a thread or 0) for each pool; the engine's
# tiles first (FP8: 177 registers uncapped, two programs an SM; bf16's wide tiles: 135 and 73.7 KB of shared
# memory, three). Compiled for sm_90: bf16 64-key tiles take 107 registers (four programs), 100 lets five fit.
# FP8 256-key tiles of 8 warps: a bare gather of 256 keys read 19% faster than of 128 (gather_rate.py)
REG_CONFIGS = {
    True: [(128, 4, 4, True, r) for r in (0, 168, 128)] + [(128, 4, 3, True, 168), (64, 4, 3, True, 128), (64, 4, 4, True, 96),
           (256, 8, 3, True, 0), (256, 8, 2, True, 128)],
    False: [(128, 4, 2, False, 0), (128, 4, 3, True, 0), (64, 4, 3, True, 0), (64, 4, 3, True, 100),
            (64, 4, 4, True, 100), (32, 4, 4, True, 0), (64, 8, 3, True, 0)],
}  # fmt: skip


def sweep_regs(bs: int, fp8: bool, call: Any, ref: torch.Tensor, kv_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for bn, warps, stages, even, regs in REG_CONFIGS[fp8]:
        attn.DECODE_CONFIG = attn.DecodeConfig(bn, warps, stages, even, regs or None)
        row: dict[str, Any] = {"bs": bs, "fp8": fp8, "block_n": bn, "warps": warps, "stages": stages,
                               "even": even, "maxnreg": regs}  # fmt: skip
        try:
            row["rel_diff"] = (call().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            us = graph_us(call)
            row |= {"us": us, "tb_s": kv_bytes / us / 1e6}
        except Exception as e:  # a configuration the compiler refuses is a row, not the end
            row["error"] = str(e)[:200]
        finally:
            attn.DECODE_CONFIG = None
        rows.append(row)
    return rows


def sweep_order(
    bs: int,
    fp8: bool,
    chosen: int,
    args: tuple[torch.Tensor, ...],
    scales: tuple,
    lens: list[int],
    kv_bytes: int,
) -> list[dict[str, Any]]:
    order = torch.tensor(attn.decode_order(lens), dtype=torch.int32, device="cuda")
    rows, line = [], []
    d = args[0].shape[-1]
    for splits in sorted({1, 2, 4, chosen}):
        plain = partial(attn.decode_attention, *args, splits, d**-0.5, *scales)
        ordered = partial(attn.decode_attention, *args, splits, d**-0.5, *scales, None, order)
        if not torch.equal(plain(), ordered()):
            raise SystemExit(f"bs={bs} fp8={fp8} splits={splits}: the ordered output differs")
        us_plain, us_ordered = graph_us(plain), graph_us(ordered)
        rows.append({"bs": bs, "fp8": fp8, "splits": splits, "chosen": splits == chosen, "us": us_plain,
                     "us_ordered": us_ordered, "tb_s": kv_bytes / us_plain / 1e6,
                     "tb_s_ordered": kv_bytes / us_ordered / 1e6})  # fmt: skip
        line.append(f"{splits}{'*' if splits == chosen else ''}: {us_plain:.1f} -> {us_ordered:.1f}")
    print(f"bs={bs} fp8={int(fp8)} us, batch order -> longest first: {'; '.join(line)}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,32,48,64,96,128,192,256")
    p.add_argument("--json")
    p.add_argument("--sweep", choices=["splits", "regs", "order"], default="splits")
    p.add_argument("--kv", choices=["both", "bf16", "fp8"], default="both", help="the pools to time")
    args = p.parse_args()
    from decode_variants import clocks_up, kv_pools, scattered_batch

    hq, hk, d = 16, 8, 128
    clocks_up()
    results: list[dict[str, Any]] = []
    for bs in (int(b) for b in args.batches.split(",")):
        if args.json:  # after every batch: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        lens, table, rows, seq = scattered_batch(bs)
        total = sum(lens)
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
        for fp8 in {"both": (False, True), "bf16": (False,), "fp8": (True,)}[args.kv]:
            k, v, scales = kv_pools(total + 64, hk, d, fp8)
            pool_scales = scales if fp8 else (None, None)
            kv_bytes = 2 * total * hk * d * k.element_size()
            chosen = attn.decode_splits(bs, hk)
            ref = attn.decode_attention(q, k, v, table, rows, seq, 1, d**-0.5, *pool_scales).float()
            if args.sweep == "regs":
                # started longest first where the engine orders the batch
                order = None
                if attn.ordered_from(bs, int(ENV.DECODE_LONGEST_FIRST.value)):
                    order = torch.tensor(attn.decode_order(lens), dtype=torch.int32, device="cuda")
                call = partial(
                    attn.decode_attention,
                    q,
                    k,
                    v,
                    table,
                    rows,
                    seq,
                    chosen,
                    d**-0.5,
                    *pool_scales,
                    None,
                    order,
                )
                engine = {"bs": bs, "fp8": fp8, "config": "engine", "us": graph_us(call)}
                found = sweep_regs(bs, fp8, call, ref, kv_bytes)
                results += [engine, *found]
                timed = sorted((r for r in found if "us" in r), key=lambda r: r["us"])
                print(f"bs={bs} fp8={int(fp8)} engine {engine['us']:.1f} us; fastest " + "; ".join(
                    f"{r['block_n']},{r['warps']},{r['stages']},{int(r['even'])},{r['maxnreg']}: {r['us']:.1f} us "
                    f"({r['tb_s']:.2f} TB/s, rel {r['rel_diff']:.1e})" for r in timed[:4]), flush=True)  # fmt: skip
                for r in found:
                    if r.get("rel_diff", 0) > 0.02 or "error" in r:
                        print("    BAD", r, flush=True)
                continue
            if args.sweep == "order":
                results += sweep_order(
                    bs, fp8, chosen, (q, k, v, table, rows, seq), pool_scales, lens, kv_bytes
                )
                continue
            line = []
            for splits in SPLITS:
                call = partial(
                    attn.decode_attention, q, k, v, table, rows, seq, splits, d**-0.5, *pool_scales
                )
                diff = (call().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
                us = graph_us(call)
                row = {"bs": bs, "fp8": fp8, "splits": splits, "chosen": splits == chosen, "us": us,
                       "tb_s": kv_bytes / us / 1e6, "rel_diff": diff, "max_len": max(lens),
                       "mean_len": total / bs}  # fmt: skip
                results.append(row)
                line.append(f"{splits}{'*' if splits == chosen else ''}:{us:.1f}")
            best = min((r for r in results if r["bs"] == bs and r["fp8"] == fp8), key=lambda r: r["us"])
            print(f"bs={bs} fp8={int(fp8)} us by splits {' '.join(line)}  best {best['splits']} "
                  f"({best['tb_s']:.2f} TB/s)", flush=True)  # fmt: skip

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
