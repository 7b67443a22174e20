"""The scheduler's time to hand out KV pages: one prompt's pages, and a decode step's, on a large pool.

    python benchmark/offline/page_alloc.py [--pages 1000000] [--prompt 1024] [--batch 256]

With pages of one slot (the engine's default) a prompt takes a page a token; an H200's pool holds about a
million slots of the Qwen3-0.6B shape. Printed: the median over 20 fresh rows of `allocate_paged` for one
prompt (the page table on the CPU, as a CPU engine holds it), then of a decode step in which each of
`--batch` running requests takes its next page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from minisgl.core import Req, SamplingParams  # noqa: E402
from minisgl.kvcache.base import MatchResult  # noqa: E402
from minisgl.scheduler.cache import CacheManager  # noqa: E402


def new_req(idx: int, n: int) -> Req:
    return Req(input_ids=list(range(n)), table_idx=idx, cached_len=0, output_len=1, uid=idx,
               sampling_params=SamplingParams(max_tokens=1), cache_handle=None, seed=0)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=1_000_000)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    rows = max(21, args.batch)
    cm = CacheManager(args.pages, 1, torch.zeros(rows, args.prompt + 64, dtype=torch.int32), "naive")
    times = []
    for idx in range(21):
        req = new_req(idx, args.prompt)
        cm.attach_prefix(idx, MatchResult(None, [], 0))
        start = time.perf_counter()
        cm.allocate_paged([req])
        times.append((time.perf_counter() - start) * 1e3)
        cm.free_req(req)
    print(f"one prompt of {args.prompt} tokens: {statistics.median(times[1:]):.3f} ms (median of 20)")
    reqs = []
    for idx in range(args.batch):
        reqs.append(new_req(idx, 16))
        cm.attach_prefix(idx, MatchResult(None, [], 0))
    cm.allocate_paged(reqs)
    times = []
    for _ in range(21):
        for req in reqs:  # one more token each: its KV goes on a new page
            req.cached_len = req.device_len
            req.device_len += 1
        start = time.perf_counter()
        cm.allocate_paged(reqs)
        times.append((time.perf_counter() - start) * 1e3)
    print(f"a decode step of {args.batch} requests: {statistics.median(times[1:]):.3f} ms (median of 20)")


if __name__ == "__main__":
    main()
