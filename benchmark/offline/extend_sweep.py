"""Prefill (extend) attention on one GPU: the engine's tiles against a sweep, and torch's SDPA beside them.

    python benchmark/offline/extend_sweep.py [--json out.json]

Prefill attention is compute-bound (4 x head_dim x query heads FLOPs a causal query-key pair) and grows with
the square of a prompt, so a long prompt's first token is mostly this kernel: one 32,768-token prompt on the
Qwen3-0.6B shape is 123 TFLOP of attention against 29 TFLOP of GEMMs. Cases (16 query heads, 8 KV heads,
head dim 128, a bf16 pool of page size 1, each prompt's slots in one run as the engine places them):
  8k       one prompt of 8,192 new tokens;
  32k      one prompt of 32,768 new tokens;
  chunk    8,192 new tokens after a cached prefix of 24,576 (the last chunk of a 32k prompt);
  workload 8,192 tokens of 13 prompts of U[100, 1,024], the last cut to fit (a prefill step of
           the upstream workload).
and `qQ_pP`, requests of Q new tokens after a cached prefix of P (about 8,192 new tokens a step; with `--short`,
query tiles of 16-64 rows for the steps of short prompts). Each configuration (ExtendConfig: query and key tiles,
warps, stages, unmasked tiles below the diagonal, longest blocks first) is checked against the engine's output, then timed (roofline.py's bench_ms: the median
of 20 launches between CUDA events). torch's SDPA (its flash kernel, causal, GQA) runs on the same one-prompt data, contiguous.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roofline import bench_ms  # noqa: E402

from minisgl.kernel import attention as attn  # noqa: E402

HQ, HK, D = 16, 8, 128


GRID_Q = [16, 32, 64, 128, 256, 512, 1024]
GRID_P = [0, 1024, 4096]


def case(name: str) -> tuple[list[int], list[int]]:
    """(context lengths, new tokens) of each request of a case; `qQ_pP`: requests of Q new tokens after a cached
    prefix of P, about 8,192 new tokens in all (at most 256 requests)."""
    if name.startswith("q"):
        q, p = (int(x) for x in name[1:].split("_p"))
        n = max(1, min(256, 8192 // q))
        return [p + q] * n, [q] * n
    if name == "8k":
        return [8192], [8192]
    if name == "32k":
        return [32768], [32768]
    if name == "chunk":
        return [32768], [8192]
    rng = random.Random(0)
    lens, total = [], 0
    while total < 8192:
        n = min(rng.randint(100, 1024), 8192 - total)
        lens.append(n)
        total += n
    return lens, lens


def configs(short: bool = False) -> list[attn.ExtendConfig]:
    """The sweep's tiles; `short`: query tiles of 16-64 rows too, for steps of short prompts (a 128-row tile of a
    16-token prompt is mostly padding), without the variants that matter only on long prompts."""
    out = []
    if short:
        for (bm, warps), bn, stages in itertools.product(
            [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8)], [32, 64, 128], [2, 3]
        ):
            out.append(attn.ExtendConfig(bm, bn, warps, stages))
        return [*out, attn.LARGE]  # the long prompts' tiles, which short ones took before
    for (bm, warps), bn, stages, even, longest in itertools.product(
        [(128, 8), (64, 4)], [64, 128], [2, 3], [False, True], [False, True]
    ):
        out.append(attn.ExtendConfig(bm, bn, warps, stages, even, longest))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="8k,32k,chunk,workload")
    p.add_argument("--short", action="store_true", help="query tiles of 16-64 rows (configs(short=True))")
    p.add_argument("--json")
    args = p.parse_args()
    results: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        lens, q_lens = case(name)
        total = sum(lens)
        k = torch.randn(total + 64, HK, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device="cuda")
        start = 0
        for i, n in enumerate(lens):
            table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        q = torch.randn(sum(q_lens), HQ, D, dtype=torch.bfloat16, device="cuda")
        i32 = dict(dtype=torch.int32, device="cuda")
        starts = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))], **i32)
        call_args = (q, k, v, table, torch.arange(len(lens), **i32), torch.tensor(lens, **i32), starts,
                     torch.tensor(q_lens, **i32), max(q_lens), D**-0.5)  # fmt: skip
        pairs = sum(m * (n - m) + m * (m + 1) // 2 for n, m in zip(lens, q_lens))
        tflop = 4 * D * HQ * pairs / 1e12
        ref = attn.extend_attention(*call_args).float()
        run = partial(attn.extend_attention, *call_args)
        engine_ms = bench_ms(run)
        row: dict[str, Any] = {
            "case": name,
            "config": "engine",
            "ms": engine_ms,
            "tflop_s": tflop / engine_ms * 1e3,
        }
        results.append(row)
        line = [f"{name}: {tflop:.1f} TFLOP; engine {engine_ms:.3f} ms ({row['tflop_s']:.0f} TFLOP/s)"]
        if len(lens) == 1 and lens == q_lens:  # one fresh prompt: SDPA's causal mask is the same
            qs = q.view(1, -1, HQ, D).transpose(1, 2)
            ks = k[: lens[0]].view(1, -1, HK, D).transpose(1, 2)
            vs = v[: lens[0]].view(1, -1, HK, D).transpose(1, 2)
            sdpa = partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, enable_gqa=True)
            diff = (sdpa().transpose(1, 2).reshape(ref.shape).float() - ref).abs().max().item()
            sdpa_ms = bench_ms(sdpa)
            results.append({"case": name, "config": "torch sdpa", "ms": sdpa_ms, "max_diff": diff,
                            "tflop_s": tflop / sdpa_ms * 1e3})  # fmt: skip
            line.append(f"sdpa {sdpa_ms:.3f} ms ({tflop / sdpa_ms * 1e3:.0f})")
        found = []
        for cfg in configs(args.short):
            attn.EXTEND_CONFIG = cfg
            r: dict[str, Any] = {"case": name, "config": [cfg.block_m, cfg.block_n, cfg.num_warps,
                                 cfg.num_stages, int(cfg.even), int(cfg.longest_first)]}  # fmt: skip
            try:
                r["max_diff"] = (run().float() - ref).abs().max().item()
                r["ms"] = bench_ms(run)
                r["tflop_s"] = tflop / r["ms"] * 1e3
                found.append(r)
            except Exception as e:  # a configuration the compiler refuses is a row, not the end
                r["error"] = str(e)[:300]
            finally:
                attn.EXTEND_CONFIG = None
            results.append(r)
            if r.get("max_diff", 0) > 0.05 or "error" in r:
                print("    BAD", r, flush=True)
        found.sort(key=lambda r: r["ms"])
        line += [f"{','.join(map(str, r['config']))} {r['ms']:.3f} ({r['tflop_s']:.0f})" for r in found[:5]]
        print("; ".join(line), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
