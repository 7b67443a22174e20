"""Decode attention alone, one layer call: the C kernel (attention.c) against the one of an earlier revision.

    python benchmark/offline/decode_attention_cpu.py [--against 9303eb5] [--requests 64] [--rounds 15]

The default model's shapes during a 64-stream decode (9 query heads, 3 KV heads, head_dim 64, bf16 pool
of page size 1), each request's context 32 to 160 tokens (uniform). `--layout engine` hands out slots as
the engine's pool does to requests that start together: each prompt (--min-len tokens) a run of slots,
then a slot a request a step; `--layout random` scatters every token over the pool. `--layers` pools are
cycled through, call after call, as a decode step goes through the model's layers, so a layer's K/V is out
of the caches when it comes round again, as in the engine (`--layers 1` shows the kernels on cached data).
Queries are bf16 views of a q|k|v row, as the model hands them over.

The baseline is attention.c at `--against` (the float32-query kernel by default), built from git with the
project's compiler flags into a temporary library and called as its caller then did: queries widened to
float32 first. Rounds alternate which kernel goes first, so a neighbour's load hits both alike; printed:
the median over the rounds of each round's median call (us, with the range of the rounds), the kernel alone
and with the wrapper's conversions, and what a decode step's attention would take at that rate.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from minisgl.kernel import cpu as cpu_kernels  # noqa: E402

HQ, HK, D = 9, 3, 64
KV_BF16 = 1


def build_baseline(rev: str, folder: Path) -> ctypes.CDLL:
    """attention.c (and its headers) at `rev`, compiled alone with the flags the engine builds with."""
    src = folder / "attention.c"
    for name in ("attention.c", "bf16.h", "kernels.h"):
        text = subprocess.run(
            ["git", "show", f"{rev}:minisgl/kernel/cpu/{name}"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (folder / name).write_text(text)
    target = folder / "baseline.so"
    cpu_kernels._build(target, [src], ())
    lib = ctypes.CDLL(str(target))
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.decode_attention.argtypes = [p, p, p, i32, p, i64, p, p, p, i32, i32, i32, i32, f32, i32]
    lib.decode_attention.restype = None
    return lib


def engine_slots(lens: torch.Tensor, prompt: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(page table, pool slots) as a page-size-1 pool hands them out to requests decoding together: each
    prompt a run of consecutive slots, then a slot a request a step, one step's slots side by side."""
    n, width = len(lens), int(lens.max())
    table = torch.zeros(n, width, dtype=torch.int32)
    table[:, :prompt] = torch.arange(n * prompt, dtype=torch.int32).view(n, prompt)
    nxt = n * prompt
    for t in range(prompt, width):
        running = (lens > t).nonzero()[:, 0]
        table[running, t] = torch.arange(nxt, nxt + len(running), dtype=torch.int32)
        nxt += len(running)
    return table, nxt


def random_slots(lens: torch.Tensor, prompt: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(page table, pool slots) with every token's slot a random draw from a pool a quarter larger than
    the contexts: no two rows of a request adjacent, the hardware prefetcher no help at all."""
    n, width = len(lens), int(lens.max())
    slots = n * width * 5 // 4
    return torch.randperm(slots, generator=gen)[: n * width].view(n, width).to(torch.int32), slots


def time_calls(fn: Callable[[int], object], reps: int, layers: int) -> list[float]:
    """Each call's time in us; call i reads layer i % layers."""
    out = []
    for i in range(reps):
        start = time.perf_counter_ns()
        fn(i % layers)
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="9303eb5", help="the git revision whose attention.c is the baseline")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--layout", choices=["engine", "random"], default="engine", help="how slots are scattered")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=60, help="calls a kernel makes in a round")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_kernels.library()
    assert lib is not None, "the CPU kernels could not be built here"

    gen = torch.Generator().manual_seed(0)
    n = args.requests
    lens = torch.randint(args.min_len, args.max_len + 1, (n,), generator=gen)
    table, slots = (engine_slots if args.layout == "engine" else random_slots)(lens, args.min_len, gen)
    rows = torch.randperm(n, generator=gen)
    table = table[torch.argsort(rows)].contiguous()
    k_pool = torch.randn(args.layers, slots, HK, D, generator=gen).bfloat16()
    v_pool = torch.randn(args.layers, slots, HK, D, generator=gen).bfloat16()
    qkv = torch.randn(n, (HQ + 2 * HK) * D, generator=gen).bfloat16()
    q = qkv[:, : HQ * D].view(n, HQ, D)
    scale = D**-0.5

    with tempfile.TemporaryDirectory() as tmp:
        old = build_baseline(args.against, Path(tmp))

    def old_call(layer: int, qf: torch.Tensor | None = None) -> torch.Tensor:
        qf = q.float().contiguous() if qf is None else qf
        out = torch.empty_like(qf)
        old.decode_attention(
            qf.data_ptr(),
            k_pool[layer].data_ptr(),
            v_pool[layer].data_ptr(),
            KV_BF16,
            table.data_ptr(),
            table.stride(0),
            rows.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            n,
            HQ,
            HK,
            D,
            scale,
            args.threads,
        )
        return out

    def new_call(layer: int) -> torch.Tensor:
        return cpu_kernels.decode_attention(lib, q, k_pool[layer], v_pool[layer], table, rows, lens, scale)

    # the kernels alone: the same calls with their inputs and outputs made once
    qf, out_old, out_new = q.float().contiguous(), torch.empty(n, HQ, D), torch.empty(n, HQ, D)
    ptrs = (table.data_ptr(), table.stride(0), rows.data_ptr(), lens.data_ptr())

    def old_kernel(layer: int) -> None:
        kv = (k_pool[layer].data_ptr(), v_pool[layer].data_ptr(), KV_BF16)
        old.decode_attention(qf.data_ptr(), *kv, *ptrs, out_old.data_ptr(), n, HQ, HK, D, scale, args.threads)

    def new_kernel(layer: int) -> None:
        kv = (k_pool[layer].data_ptr(), v_pool[layer].data_ptr(), KV_BF16)
        lib.decode_attention(
            q.data_ptr(), 1, q.stride(0), *kv, *ptrs, out_new.data_ptr(), n, HQ, HK, D, scale, args.threads
        )

    a, b = old_call(0, qf), new_call(0)
    diff = (a - b).abs().max().item()
    print(
        f"{n} requests of {lens.min().item()}-{lens.max().item()} tokens (mean {lens.float().mean().item():.0f}), "
        f"{HQ}/{HK} heads, head_dim {D}, bf16 pool, {args.layers} layers cycled, {args.threads} thread(s)"
    )
    # the baseline keeps float32 probabilities where the kernel now rounds them to bf16, as SDPA does
    print(f"largest difference of the two kernels' outputs: {diff:.2e}")

    cases = {
        f"kernel at {args.against}": old_kernel,
        "kernel now": new_kernel,
        f"call at {args.against} (q widened)": old_call,
        "call now (wrapper)": new_call,
    }
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        time_calls(fn, args.layers, args.layers)
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            medians[name].append(statistics.median(time_calls(cases[name], args.reps, args.layers)))
    for name, ts in medians.items():
        med = statistics.median(ts)
        step_ms = med * args.layers / 1e3
        print(
            f"{name:34s} {med:8.1f} us ({min(ts):.1f}-{max(ts):.1f}); a {n}-row step's {args.layers} layers "
            f"{step_ms:.2f} ms, {n / step_ms * 1e3:,.0f} tok/s if attention were all"
        )


if __name__ == "__main__":
    main()
