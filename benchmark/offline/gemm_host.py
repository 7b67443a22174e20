"""The host's time in a cuBLAS GEMM call: a row count the process has not multiplied before against one it has.

    python benchmark/offline/gemm_host.py [--model-shape qwen3-0.6b] [--counts 40] [--json out.json]

An eager prefill step multiplies its token count of rows by every layer's weights; a step of a token count new to
the process may cost the host more in cuBLAS (its choice of kernel for the shape) than one it has seen. For each
of the shape's four products (q|k|v, o, gate|up, down) and each call form the engine uses (`F.linear`; `addmm_`
into the residual), the host's time of one call (from the call to its return, the device not waited for) is
timed at `--counts` row counts never multiplied before in the process (odd counts between 300 and 8,000, new
ones for each shape and form; the first set loads the kernels cuBLAS picks, so a second new set is the choice alone),
then again at the second set (seen), and at the same counts rounded up to a multiple of 256 after one call of each.
Printed: microseconds a call, the median of each set.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

SHAPES = {  # (out, in) of q|k|v, o, gate|up, down
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def host_us(call: Callable[[int], torch.Tensor], m: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call(m)
    spent = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    return spent


def linear(x: torch.Tensor, w: torch.Tensor, m: int) -> torch.Tensor:
    return F.linear(x[:m], w)


def addmm_(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor, m: int) -> torch.Tensor:
    return res[:m].addmm_(x[:m], w.t())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--counts", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")
    rng = random.Random(0)
    unused = rng.sample(range(301, 8000, 2), 16 * args.counts)  # each shape and form its own new counts
    results = []
    for out_f, in_f in SHAPES[args.model_shape]:
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) / in_f**0.5
        x = torch.randn(8192, in_f, device=dev, dtype=torch.bfloat16)
        res = torch.zeros(8192, out_f, device=dev, dtype=torch.bfloat16)
        forms = {
            "linear": partial(linear, x, w),
            "addmm_": partial(addmm_, res, x, w),
        }
        for form, call in forms.items():
            first, unused = unused[: args.counts], unused[args.counts :]
            counts, unused = unused[: args.counts], unused[args.counts :]
            rounded = sorted({-(-m // 256) * 256 for m in counts})
            first_fresh = [host_us(call, m) for m in first]  # with the first loads of cuBLAS's kernels
            fresh = [host_us(call, m) for m in counts]
            seen = [host_us(call, m) for m in counts]
            for m in rounded:
                call(m)
            bucketed = [host_us(call, -(-m // 256) * 256) for m in counts]
            row = {
                "shape": [out_f, in_f], "form": form,
                "first_new_us": statistics.median(first_fresh), "fresh_us": statistics.median(fresh),
                "seen_us": statistics.median(seen),
                "rounded_us": statistics.median(bucketed),
            }  # fmt: skip
            results.append(row)
            print(f"{out_f:6d} x {in_f:5d} {form:7s}: first new counts {row['first_new_us']:7.1f} us, "
                  f"new counts after them {row['fresh_us']:7.1f} us, "
                  f"seen {row['seen_us']:6.1f} us, rounded to 256 and seen {row['rounded_us']:6.1f} us", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_shape": args.model_shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
