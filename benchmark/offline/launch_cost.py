"""Host time of one kernel launch, by path: Triton's JIT call, its compiled kernel called directly, torch.

    python benchmark/offline/launch_cost.py [--json out.json]

A prefill step launches about 260 kernels from the host. Each path below launches the RMSNorm kernel
(with the residual, as every layer does) on a [16, 1024] bf16 batch 2,000 times without synchronising
and reports the host's microseconds a launch (the kernel itself takes a few microseconds, so the host
is what is timed):
  wrapper   minisgl.kernel.norm.rms_norm_residual as the engine calls it: the output allocations, then
            the kernel through minisgl.kernel.launch.Launcher;
  wrapper_jit  the same wrapper with the kernel launched through Triton's JIT call instead;
  jit       Triton's _rms_norm_kernel[grid](...): it binds and specialises the arguments, builds the cache
            key, checks the globals it compiled with, then calls the launcher;
  launcher  Launcher's [grid](...): Triton's binder, a tuple key, the launcher's C call;
  compiled  the CompiledKernel the JIT call returned, called as compiled[grid](*args): no binding, no key;
  run       compiled.run(...) with the stream, function handle and metadata looked up once: the launcher's
            C code alone (argument conversion and cuLaunchKernelEx);
  torch     torch.add(x, r, out=y), one aten kernel, for scale.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch


def per_launch_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        best = min(best, host / n * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args()
    import triton

    from minisgl.kernel import norm
    from minisgl.kernel.norm import rms_norm_residual

    launcher = norm._rms_norm_kernel
    jit_fn = launcher.fn

    x = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
    y, ro = torch.empty_like(x), torch.empty_like(x)
    grid = (8, 1, 1)  # 16 rows, 2 a program: as rms_norm_residual launches it
    params = (x, r, y, ro, w, 16, 1, 1024, 0, 1024, 1024, 1024, 1e-6)
    meta = {"N": 1024, "BLOCK_N": 1024, "ROWS": 2, "HAS_RES": True}

    def jit() -> Any:
        return jit_fn[grid](*params, **meta, num_warps=4)

    def wrapper_jit() -> Any:
        norm._rms_norm_kernel = jit_fn
        try:
            return rms_norm_residual(x, r, w, 1e-6)
        finally:
            norm._rms_norm_kernel = launcher

    compiled = jit()
    every = (*params, *meta.values())  # the launcher takes every parameter, constexprs included
    runner = compiled[grid]
    stream = torch.cuda.current_stream().cuda_stream
    fn_handle, packed = compiled.function, compiled.packed_metadata

    def run() -> None:
        compiled.run(8, 1, 1, stream, fn_handle, packed, None, None, None, *every)

    paths: dict[str, Callable[[], Any]] = {
        "wrapper": lambda: rms_norm_residual(x, r, w, 1e-6),
        "wrapper_jit": wrapper_jit,
        "jit": jit,
        "launcher": lambda: launcher[grid](*params, **meta, num_warps=4),
        "compiled": lambda: runner(*every),
        "run": run,
        "torch": lambda: torch.add(x, r, out=y),
    }
    want = rms_norm_residual(x, r, w, 1e-6)[0]
    result: dict[str, Any] = {
        "triton": triton.__version__,
        "torch_version": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(),
    }
    for name, fn in paths.items():
        try:
            us = per_launch_us(fn)
            if name in ("jit", "launcher", "compiled", "run"):  # each writes y as the wrapper does
                y.zero_()
                fn()
                torch.cuda.synchronize()
                assert torch.equal(y, want), f"{name} wrote other values than the JIT path"
            result[name] = round(us, 2)
        except Exception as e:  # a path this Triton lacks is a row, not the end
            result[name] = f"error: {str(e)[:200]}"
        print(name, result[name], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
