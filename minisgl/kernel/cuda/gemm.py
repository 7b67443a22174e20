"""Products of few rows on Hopper (`gemm.cu`): y = x @ w.T (+ residual) for the decode steps of 1-8 rows.

Why a product of our own there: at one row cuBLAS reads a Qwen3-0.6B step's weights at a third of the copy rate,
and each product's first reads ramp up after its launch (docs/benchmarks.md, "A decode GEMM on the tensor cores").
This kernel asks for its weight tiles before it waits for its input, so where the decode graph's edge into it is
programmatic (engine/graph_edges.py) the ramp runs under the kernel before it. Bound by
MINISGL_CUDA_GEMM_ROWS (0: off); a device before Hopper (no clusters, no programmatic launch), another dtype or a
shape the tiles do not divide keeps the split-K Triton GEMM or cuBLAS.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from minisgl.env import ENV
from minisgl.kernel.cuda import CudaModule, CudaUnavailable, load_module, source
from minisgl.kernel.launch import programmatic_launch

BN, BM, WN, WM, STAGES = 64, 16, 4, 1, 4  # the tile measured fastest at 1-16 rows on every decode shape
SPLITS = (8, 4, 2, 1)  # programs a tile (a cluster: at most 8 portably)
BK = 64
THREADS = WN * WM * 32
# the largest weight (elements) it takes: at 1-8 rows it beat cuBLAS and the split-K GEMM on each Qwen3-0.6B
# product (1-6M elements: a read of 2-13 MB, where a kernel's ramp is a large share) and lost on Llama-3-8B's
# (17-117M), a decode graph step 1-2% slower there (docs/benchmarks.md, "Products of few rows of our own")
MAX_WEIGHT = 8 << 20
KERNEL_PATTERN = r"gemm_n\d+_m\d+_w\d+x\d+_s\d+_p\d+"  # the kernels' names, for engine/graph_edges.py


@dataclass(frozen=True)
class Tiles:
    split: int

    @property
    def name(self) -> str:
        return f"gemm_n{BN}_m{BM}_w{WN}x{WM}_s{self.split}_p{STAGES}"

    @property
    def shared(self) -> int:
        # the stages' weight and token tiles, or the partial sums after them, whichever is larger
        return max(STAGES * (BN + BM) * 128, BM * (BN + 4) * 4)


def choose_split(n: int, k: int, sms: int) -> int:
    """The most programs a tile whose K ranges are whole 64-column blocks, while the grid stays within two
    programs an SM: on each Qwen3-0.6B shape at 1 and 8 rows the sweep's fastest split or within 3% of it
    (docs/results/gpu_qwen3_0.6b_gemm_cuda_2026-12-04.json)."""
    tiles = n // BN
    for split in SPLITS:
        if k % (BK * split) == 0 and (tiles * split <= 2 * sms or split == 1):
            return split
    return 1


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def serves(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether this kernel takes x [M, K] @ w.T for w [N, K] (plus `residual` [M, N], written over): on a Hopper
    GPU, bf16, M within MINISGL_CUDA_GEMM_ROWS, N a whole number of tiles, K of 64-column blocks, a weight of at
    most MAX_WEIGHT elements, every row read or written 16 bytes at a time (aligned)."""
    rows = ENV.CUDA_GEMM_ROWS.value
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= min(rows, BM)):
        return False
    n, k = w.shape
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.shape[1] == k
        and n % BN == 0
        and k % BK == 0
        and n * k <= MAX_WEIGHT
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and w.is_contiguous()
        and w.data_ptr() % 16 == 0
        and (residual is None or (_aligned_rows(residual) and residual.shape == (x.shape[0], n)))
        and programmatic_launch(x.device.index or 0)
        and _module_or_none(x.device.index or 0) is not None
    )


def _aligned_rows(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def program() -> str:
    """gemm.cu with a kernel for every split."""
    lines = [source("gemm.cu")]
    for split in SPLITS:
        t = Tiles(split)
        lines.append(f"GEMM_KERNEL({t.name}, {BN}, {BM}, {WN}, {WM}, {split}, {STAGES})")
    return "\n".join(lines) + "\n"


@cache
def _module_or_none(index: int) -> CudaModule | None:
    """The kernels loaded on device `index`, or None where NVRTC or the driver cannot give them (the caller's
    other products serve instead)."""
    try:
        mod = load_module(program(), "gemm.cu", index)
    except CudaUnavailable:
        return None
    for split in SPLITS:
        t = Tiles(split)
        mod.allow_shared(t.name, t.shared)
    return mod


def matmul(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T, float32 sums rounded once to bf16; with `residual` [M, N] (contiguous rows), residual + x @ w.T
    written over residual (the add on the float32 sums, as cuBLAS's addmm does). `serves(x, w)` must hold."""
    m, k = x.shape
    n = w.shape[0]
    index = x.device.index or 0
    mod = _module_or_none(index)
    assert mod is not None, "serves() first"
    if residual is not None:
        assert residual.shape == (m, n) and _aligned_rows(residual)
        y = residual
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    t = Tiles(choose_split(n, k, _sm_count(index)))
    args = (
        x.data_ptr(), w.data_ptr(), y.data_ptr(), residual.data_ptr() if residual is not None else 0,
        ctypes.c_int32(m), ctypes.c_int32(k), ctypes.c_int64(x.stride(0)), ctypes.c_int64(w.stride(0)),
        ctypes.c_int64(y.stride(0)), ctypes.c_int64(y.stride(0)),
    )  # fmt: skip
    grid = (n // BN * t.split, -(-m // BM), 1)
    mod.launch(t.name, grid, THREADS, args, torch.cuda.current_stream(x.device).cuda_stream, t.shared)
    return y
