"""Prefill attention alone, one layer: the C kernel (attention.c) against the torch backend's SDPA.

    python benchmark/offline/prefill_attention.py [--tokens 500] [--threads 1] [--rounds 5]

The default model's shapes (9 query heads, 3 KV heads, head_dim 64), one request of `--tokens` new tokens in a
bf16 pool of page size 1, its slots scattered. Each round times, in turn, the torch backend's whole
prefill forward (gather, padded batch, mask, SDPA; metadata built once), its SDPA call alone and the kernel,
with bf16 and float32 queries; printed: the median of each over the rounds and their range, in ms, and the
attention's FLOP floor (4 * heads * head_dim * causal pairs) with the rate it implies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from minisgl.attention.torch_backend import TorchAttnBackend  # noqa: E402
from minisgl.core import Batch, Req, SamplingParams  # noqa: E402
from minisgl.kernel import cpu as cpu_kernels  # noqa: E402
from minisgl.kvcache.mha_pool import MHAKVCache  # noqa: E402


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.library()
    assert lib is not None, "the CPU kernels could not be built here"
    n, hq, hk, d = args.tokens, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    pool = MHAKVCache(1, 4 * n, 1, hk, d, torch.bfloat16, torch.device("cpu"))
    table = torch.randperm(4 * n, generator=gen)[:n].to(torch.int32)[None]
    slots = table[0].long()
    pool.k_buffer[0, slots] = torch.randn(n, hk, d, generator=gen).bfloat16()
    pool.v_buffer[0, slots] = torch.randn(n, hk, d, generator=gen).bfloat16()
    q = torch.randn(n, hq, d, generator=gen).bfloat16()
    k, v = pool.k_buffer[0, slots], pool.v_buffer[0, slots]

    backend = TorchAttnBackend(pool, table, torch.device("cpu"))
    req = Req(
        input_ids=list(range(n)),
        table_idx=0,
        cached_len=0,
        output_len=1,
        uid=0,
        sampling_params=SamplingParams(max_tokens=1),
        cache_handle=None,
        seed=0,
    )
    batch = Batch([req], "prefill")
    batch.out_loc = slots
    backend.prepare_metadata(batch)
    meta = batch.attn_metadata
    kg = k.transpose(0, 1)[None]
    vg = v.transpose(0, 1)[None]
    qg = q.transpose(0, 1)[None]
    rows, prefix, extend = torch.tensor([0]), torch.tensor([0]), torch.tensor([n])
    qf = q.float()
    cases: dict[str, Callable[[], object]] = {
        "torch backend forward": lambda: backend.forward(q, k, v, 0, batch, kv_stored=True),
        "SDPA alone": lambda: F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=meta.mask, enable_gqa=True
        ),
        "C kernel, bf16 q": lambda: cpu_kernels.prefill_attention(
            lib, q, pool.k_cache(0), pool.v_cache(0), table, rows, prefix, extend, d**-0.5
        ),
        "C kernel, float32 q": lambda: cpu_kernels.prefill_attention(
            lib, qf, pool.k_cache(0), pool.v_cache(0), table, rows, prefix, extend, d**-0.5
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_time(fn, args.reps))
    flops = 4 * hq * d * n * (n + 1) / 2
    print(
        f"{n} tokens, {hq}/{hk} heads, head_dim {d}, bf16 pool, {args.threads} thread(s); floor {flops / 1e6:.1f} MFLOP"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:24s} {med:7.2f} ms ({min(ts):.2f}-{max(ts):.2f})  {flops / med / 1e6:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
