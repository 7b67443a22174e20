"""Where the temperature sampler's time goes, on one GPU: the engine's kernel against variants of it.

    python benchmark/offline/sampler_variants.py [--rows 64,128,256] [--json out.json]

The engine's sampler (minisgl/kernel/sampling.py, `sample_tokens`) reads each float32 logit once: at 256
rows of Qwen3's 151,936 tokens that is 155 MB, 37 us at the copy rate, and it took 220 us (docs/benchmarks.md,
"Sampling filters and the first run of a process"), so something other than bytes bounds it. Each variant
takes one piece of its per-token work away or makes it cheaper, over the same logits:
  engine    sample_tokens as the engine calls it (since 2026-12-03 its noise in base 2: `same`);
  ln        the noise through natural logs (tl.log), as the engine's kernel took it before;
  copy      the same kernel shape keeping only the argmax of the logits (the bytes' floor with this grid);
  no_noise  the temperature's division and the argmax, no hash and no logs;
  recip     the hash and the logs, the division replaced by a product with 1 / T (other bits than torch's);
  hash32    the division and the logs, a 32-bit hash instead of 64-bit splitmix (another noise stream);
  cheap     both: product with 1 / T and the 32-bit hash;
each at the engine's grid (blocks of 2,048 tokens, 4 warps, up to 32 chunks a row) and with 8 warps or 64
chunks. Timed as 20 launches captured in one CUDA graph, the median of 10 replays, us a launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from minisgl.kernel.sampling import (  # noqa: E402
    _hash_base,
    _hash_uniform,
    _log2,
    _sample_merge_kernel,
    sample_tokens,
)
from minisgl.utils.misc import div_ceil, next_pow2  # noqa: E402

# (noise, division, hash, log): noise 0 none; division 0 by reciprocal, 1 rounded as torch divides; hash 64
# or 32 bits; log 0 natural (tl.log), 1 base 2 by PTX's lg2.approx (the engine's since 2026-12-03)
VARIANTS = {
    "copy": (0, 0, 64, 1),
    "no_noise": (0, 1, 64, 1),
    "ln": (1, 1, 64, 0),
    "recip": (1, 0, 64, 1),
    "hash32": (1, 1, 32, 1),
    "cheap": (1, 0, 32, 1),
    "same": (1, 1, 64, 1),  # the engine's work in this copy of the kernel, to check the copy's grid matches
}


@triton.jit
def _variant_kernel(
    Logits,
    stride_l,
    Temps,
    Seeds,
    Steps,
    BestV,
    BestI,
    V,
    CHUNK,
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    NOISE: tl.constexpr,
    DIV: tl.constexpr,
    HASH: tl.constexpr,
    LOG: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    inv = 1.0 / temp
    base = _hash_base(Seeds, Steps, r)
    base32 = (base ^ (base >> 32)).to(tl.uint32)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    end = tl.minimum(c * CHUNK + CHUNK, V)
    for off in range(c * CHUNK, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        logit = tl.load(Logits + r * stride_l + idx, mask=mask, other=float("-inf")).to(tl.float32)
        if DIV:
            scaled = tl.div_rn(logit, temp)
        else:
            scaled = logit * inv
        if NOISE:
            if HASH == 64:
                u = _hash_uniform(base, idx)
            else:
                y = base32 ^ (idx.to(tl.uint32) * 0x9E3779B9)
                y = (y ^ (y >> 16)) * 0x7FEB352D
                y = (y ^ (y >> 15)) * 0x846CA68B
                y = y ^ (y >> 16)
                u = ((y >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            if LOG:
                score = scaled * 1.4426950408889634 - _log2(-_log2(u, True), True)
            else:
                score = scaled - tl.log(-tl.log(u))
        else:
            score = scaled
        score = tl.where(mask, score, float("-inf"))
        better = score > best_v
        best_v = tl.where(better, score, best_v)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best_v, 0)
    tl.store(BestV + r * NUM_CHUNKS + c, top)
    tl.store(BestI + r * NUM_CHUNKS + c, tl.min(tl.where(best_v == top, best_i, V), 0))


def variant(
    logits: torch.Tensor,
    temps: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    flags: tuple[int, int, int, int],
    warps: int,
    max_chunks: int,
) -> torch.Tensor:
    bs, vocab = logits.shape
    block = min(2048, next_pow2(vocab))
    num_chunks = min(max_chunks, next_pow2(div_ceil(vocab, 4 * block)))
    chunk = div_ceil(div_ceil(vocab, num_chunks), block) * block
    best_v = torch.empty((bs, num_chunks), dtype=torch.float32, device=logits.device)
    best_i = torch.empty((bs, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    noise, div, hsh, log = flags
    _variant_kernel[(bs, num_chunks)](
        logits, logits.stride(0), temps, seeds, steps, best_v, best_i, vocab, chunk,
        NUM_CHUNKS=num_chunks, BLOCK=block, NOISE=noise, DIV=div, HASH=hsh, LOG=log,
        num_warps=warps,
    )  # fmt: skip
    _sample_merge_kernel[(bs,)](best_v, best_i, out, vocab, NUM_CHUNKS=num_chunks, num_warps=1)
    return out


def graph_us(fn: Callable[[], object], launches: int = 20) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for bs in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(bs, args.vocab, device="cuda", generator=gen) * 3
        temps = torch.full((bs,), 0.6, device="cuda")
        seeds = torch.arange(bs, device="cuda", dtype=torch.int64) * 7919
        steps = torch.full((bs,), 123, device="cuda", dtype=torch.int64)
        want = sample_tokens(logits, temps, seeds, steps)
        same = variant(logits, temps, seeds, steps, VARIANTS["same"], 4, 32)
        if not torch.equal(same, want):
            raise SystemExit(f"rows={bs}: the copy of the kernel samples other tokens than the engine's")
        row = {"rows": bs, "bytes_us": logits.numel() * 4 / 4.2e12 * 1e6}
        inputs = (logits, temps, seeds, steps)
        row["engine"] = graph_us(lambda inputs=inputs: sample_tokens(*inputs))
        for name, flags in VARIANTS.items():
            for warps, chunks in ((4, 32), (8, 32), (4, 64)):
                row[f"{name}/w{warps}/c{chunks}"] = graph_us(
                    lambda inputs=inputs, flags=flags, warps=warps, chunks=chunks: variant(
                        *inputs, flags, warps, chunks
                    )
                )
        results.append(row)
        keys = [k for k in row if k not in ("rows",)]
        print(f"rows={bs}: " + ", ".join(f"{k} {row[k]:.1f}" for k in keys), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
