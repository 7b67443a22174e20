"""Where a mixed step's time goes on a GPU: the torch profiler over the same workload, plain and mixed, and the
host syncs each schedule makes.

    python benchmark/offline/mixed_profile.py --model M [--requests 128] [--max-running-req 64] [--budget 2048]

For each schedule (plain; `enable_mixed_chunk=True`; the same with MINISGL_MIXED_DECODE_SPLIT=0): an engine
built, a short warm-up generate, then mixed_steps.py's workload timed, once under
`torch.cuda.set_sync_debug_mode("warn")` (each synchronizing call's place in the code counted) and once under
the profiler (device kernels and host ops by total time). Printed as text; `--trace DIR` writes each
schedule's Chrome trace there, gzipped.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import shutil
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mixed_steps import build, workload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: the embedded model)")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-running-req", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--rows", type=int, default=22, help="rows of each profiler table")
    p.add_argument("--trace", default=None, help="a folder for the Chrome traces")
    args = p.parse_args()
    prompts, params = workload(args.requests)
    from minisgl.env import ENV

    for name in ("plain", "mixed", "mixed_unsplit"):
        # the decode rows through the decode kernels (the default), or with the prompts through the extend kernel
        ENV.MIXED_DECODE_SPLIT.value = name != "mixed_unsplit"
        llm = build(name != "plain", args)
        llm.generate(prompts[:8], params[:8])
        start = time.perf_counter()
        llm.generate(prompts, params)
        print(f"== {name}: {time.perf_counter() - start:.3f} s unprofiled", flush=True)
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.generate(prompts, params)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        places = collections.Counter(
            f"{os.path.relpath(w.filename)}:{w.lineno}"
            for w in caught
            if "ynchroniz" in str(w.message) and "prototype" not in str(w.message)
        )
        print(f"host syncs: {sum(places.values())}")
        for place, n in places.most_common(12):
            print(f"  {n:6d}  {place}")
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        start = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompts, params)
        wall = time.perf_counter() - start
        table = prof.key_averages()
        device = sum(getattr(e, "self_device_time_total", 0.0) for e in table) / 1e6
        print(f"profiled: {wall:.3f} s wall, the device's kernels {device:.3f} s")
        print(table.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(table.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            path = os.path.join(args.trace, f"mixed_profile_{name}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)
        llm.shutdown()


if __name__ == "__main__":
    main()
