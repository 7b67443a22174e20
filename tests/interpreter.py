"""Imported first by the Triton kernel tests: without a GPU the kernels run in Triton's interpreter on CPU
tensors (TRITON_INTERPRET counts only if set before triton is imported), on a CUDA machine compiled.
The importing test module is skipped where triton is not installed."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEVICE = torch.device("cuda" if CUDA else "cpu")
