"""Triton kernels for the GPU path; each layer keeps its torch version for the CPU and calls these on CUDA.

Importing this package never imports triton: the kernel modules do, and only the CUDA path loads them.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether `x` is computed by the Triton kernels (CUDA tensors, with triton installed)."""
    return x.is_cuda and triton_available()


def dot_precision(dtype: torch.dtype) -> str:
    """The input_precision of tl.dot for operands of `dtype`."""
    # float32 runs are the exact reference: no TF32 inside the kernels
    return "ieee" if dtype == torch.float32 else "tf32"
