"""Launching compiled Triton kernels with less host time than `kernel[grid](...)`.

On the H200 machine's CPU, Triton's launch path takes 17 us a launch and this one 12.5
(benchmark/offline/launch_cost.py): after binding and specialising the arguments Triton builds a string
cache key from them and the options, checks the globals the kernel was compiled with, canonicalises the
grid and asks for the device and its stream, before the launcher's C call. An eager prefill step makes
about 140 such launches. Here the arguments go through the kernel's own binder (so the specialisation,
and with it the compiled kernel chosen, is Triton's), the key is a tuple of what the binder returned,
and a hit calls the compiled kernel's launcher directly. A key's first launch goes through Triton, which
compiles or loads the kernel and returns it. Under Triton's interpreter, or with launch hooks installed
(profilers), every launch takes Triton's own path, as every launch does with MINISGL_DIRECT_LAUNCH=0.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton import knobs as _knobs
except ImportError:  # a Triton without knobs has no launch hooks to respect either
    _knobs = None


@cache
def programmatic_launch(device: int) -> bool:
    """Whether CUDA device `device` has programmatic dependent launch (Hopper on): below it the kernels are
    built without the wait (`griddepcontrol` is no instruction there) and no graph edge is made programmatic."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _hooked() -> bool:
    """A profiler's launch hook is installed: launches take Triton's path, which calls it."""
    if _knobs is None:
        return False
    hook = _knobs.runtime.launch_enter_hook
    # Triton keeps its launch hooks in a chain (HookChain) that is there even when empty
    return bool(getattr(hook, "calls", hook))


def _key(device: int, specialization: list[Any], options: dict[str, Any]) -> tuple[Any, ...]:
    # the binder's specialisation is a list of (type, value) tuples and its options plain numbers and
    # flags, so a tuple of them hashes as it is: a recursive walk cost 19 us a launch on a 2 GHz core
    return (device, tuple(specialization), tuple(options.items()))


class Launcher:
    """A @triton.jit kernel launched as `launcher[grid](*args, **kwargs)`, as Triton's own is."""

    def __init__(self, fn: Any, direct: bool | None = None) -> None:
        from minisgl.env import ENV

        self.fn = fn
        self.kernels: dict[tuple[Any, ...], Any] = {}
        # under the interpreter a kernel is not a JITFunction and has no compiled launcher to call
        jit = isinstance(fn, triton.runtime.JITFunction)
        self.direct = jit and (bool(ENV.DIRECT_LAUNCH.value) if direct is None else direct)
        # a kernel with a PDL parameter calls wait_for_inputs first: its level comes from the switch
        self.pdl = ENV.PDL_KERNELS if jit and "PDL" in fn.arg_names else None

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = self.fn
        # off, or a GPU before Hopper: the parameter's default (0) is the level
        if self.pdl is not None and self.pdl.value and programmatic_launch(torch._C._cuda_getDevice()):
            kwargs["PDL"] = self.pdl.value
        if not self.direct or _hooked():
            fn[grid](*args, **kwargs)
            return
        device = torch._C._cuda_getDevice()
        caches = fn.device_caches.get(device)
        if caches is None:  # this device's first launch: Triton builds its binder
            self._first(grid, args, kwargs, device)
            return
        bound, specialization, options = caches[4](*args, **kwargs)
        key = _key(device, specialization, options)
        try:
            kernel = self.kernels.get(key)
        except TypeError:  # a constexpr that does not hash: Triton's own path keys it by its text
            fn[grid](*args, **kwargs)
            return
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
        try:
            self.kernels[key] = kernel
        except TypeError:  # not hashable: this kernel's launches keep taking Triton's path
            pass


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A kernel's first call. PDL 1: where a graph edge into the kernel is programmatic (engine/graph_edges.py) it
    may start before the kernel it reads from has finished; it waits here until that one has and its writes are
    visible (on any other launch this returns at once). PDL 2: then also lets the next kernel launch, to wait
    in its turn. 0 (the interpreter, and the default): nothing."""
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()


def direct_launch(fn: Any) -> Launcher:
    """Decorator over @triton.jit: the kernel launched through a Launcher."""
    return Launcher(fn)
