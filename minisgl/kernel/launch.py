"""Launching compiled Triton kernels with less host time than `kernel[grid](...)`.

On the H200 machine's CPU, Triton's launch path takes 16 us a launch (benchmark/offline/launch_cost.py):
after binding and specialising the arguments it builds a string cache key from them and the options,
checks the globals the kernel was compiled with, canonicalises the grid and asks for the device and its
stream, before the launcher's C call. An eager prefill step makes about 140 such launches. Here the
arguments go through the kernel's own binder (so the specialisation, and with it the compiled kernel
chosen, is Triton's), the key is a tuple of what the binder returned, and a hit calls the compiled
kernel's launcher directly. A key's first launch goes through Triton, which compiles or loads the kernel
and returns it. Under Triton's interpreter, or with launch hooks installed (profilers), every launch
takes Triton's own path, as every launch does with MINISGL_DIRECT_LAUNCH=0.
"""

from __future__ import annotations

from typing import Any

import torch
import triton


def _direct_possible(fn: Any) -> bool:
    from triton import knobs

    # Triton keeps its launch hooks in a chain (HookChain) that is there even when empty
    hook = knobs.runtime.launch_enter_hook
    return isinstance(fn, triton.runtime.JITFunction) and not getattr(hook, "calls", hook)


def _hashable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    try:
        hash(x)
    except TypeError:  # a value Triton keys by its text
        return repr(x)
    return x


def _key(device: int, specialization: Any, options: dict[str, Any]) -> tuple[Any, ...]:
    return (device, _hashable(specialization), _hashable(tuple(options.items())))


class Launcher:
    """A @triton.jit kernel launched as `launcher[grid](*args, **kwargs)`, as Triton's own is."""

    def __init__(self, fn: Any) -> None:
        from minisgl.env import ENV

        self.fn = fn
        self.kernels: dict[tuple[Any, ...], Any] = {}
        self.direct = bool(ENV.DIRECT_LAUNCH.value)

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = self.fn
        if not (self.direct and _direct_possible(fn)):
            fn[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        caches = fn.device_caches.get(device)
        if caches is None:  # this device's first launch: Triton builds its binder
            self._first(grid, args, kwargs, device)
            return
        bound, specialization, options = caches[4](*args, **kwargs)
        key = _key(device, specialization, options)
        kernel = self.kernels.get(key)
        if kernel is None:
            self._first(grid, args, kwargs, device, key)
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(
            grid[0],
            g1,
            g2,
            stream,
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *bound.values(),
        )

    def _first(
        self,
        grid: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: int,
        key: tuple[Any, ...] | None = None,
    ) -> None:
        kernel = self.fn[grid](*args, **kwargs)
        if hasattr(kernel, "result"):  # a compilation handed out as a future
            kernel = kernel.result()
        if key is None:
            _, specialization, options = self.fn.device_caches[device][4](*args, **kwargs)
            key = _key(device, specialization, options)
        self.kernels[key] = kernel


def direct_launch(fn: Any) -> Launcher:
    """Decorator over @triton.jit: the kernel launched through a Launcher."""
    return Launcher(fn)
