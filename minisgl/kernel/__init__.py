"""Triton kernels for the GPU path; each layer keeps its torch version for the CPU and calls these on CUDA.

Importing this package never imports triton: the kernel modules do, and only the CUDA path loads them.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

# from this many rows (prefill steps; decode batches stay below it) SiLU takes a program a row and the rotary
# kernel a program a token, so that a folded norm's row scale is reduced once a row; the start-up warm-up
# runs a step of this many tokens to compile those layouts (engine/warmup.py)
ROWS_WHOLE = 1024


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_everywhere() -> bool:
    """Whether MINISGL_KERNELS=triton asks for the CUDA path's Triton kernels on every device."""
    from minisgl.env import ENV

    choice = ENV.KERNELS.value
    if choice not in ("auto", "triton"):
        raise ValueError(f"MINISGL_KERNELS={choice!r} is unknown; use auto or triton")
    return choice == "triton"


def use_triton(x: torch.Tensor) -> bool:
    """Whether `x` is computed by the Triton kernels (CUDA tensors, or any with MINISGL_KERNELS=triton)."""
    return (x.is_cuda or triton_everywhere()) and triton_available()


def dot_precision(dtype: torch.dtype) -> str:
    """The input_precision of tl.dot for operands of `dtype`."""
    # float32 runs are the exact reference: no TF32 inside the kernels
    return "ieee" if dtype == torch.float32 else "tf32"
