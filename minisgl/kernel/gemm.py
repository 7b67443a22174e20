"""Matmuls of few rows (decode steps) on CUDA: y = x @ w.T for x [M, K], w [N, K], with K split over the SMs.

Why: at decode batch sizes a small model's projections are too narrow to spread over the GPU as cuBLAS
tiles them: on an H200 a Qwen3-0.6B-shaped step's GEMMs read the weights at 1.35 TB/s at batch 1, a
third of the copy rate (docs/benchmarks.md, "The fixed cost of a decode step"). Here each program
computes a BLOCK_M x BLOCK_N tile over one of `split` ranges of K, enough programs to fill every SM. With a split, each program writes its float32 partial sums to a workspace and takes a ticket
from its tile's counter; the program that draws the last ticket adds the partials in split order (so
the result does not depend on which program finished first) and writes the output. One launch, and
deterministic; the counters are left at zero for the next call, so a CUDA graph can replay it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch, wait_for_inputs
from minisgl.utils.misc import div_ceil, next_pow2

# the largest batch served here: above it cuBLAS measured faster on every shape (docs/benchmarks.md)
MAX_ROWS = 16
_WORKSPACE_FLOATS = 8 << 20  # 32 MiB of float32 partial sums a device
_COUNTERS = 1 << 16


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 4


def serves(m: int, n: int, k: int) -> bool:
    """Whether this kernel takes an [m, k] x [k, n] product: few rows, and outputs no wider than the
    reduction (o_proj, down_proj), where cuBLAS's few tiles leave most SMs idle; wider outputs (q|k|v,
    gate|up) it tiles well itself (measured: docs/benchmarks.md, "Decode GEMMs of few rows")."""
    return m <= MAX_ROWS and n <= k


@cache  # called for every few-row product of every step: the answer depends on the shape only
def choose_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """Tiles for an [m, k] x [k, n] product: M padded to tensor-core rows, narrow N tiles, K split until
    the programs fill every SM once, each split keeping at least two K blocks."""
    block_m = min(max(16, next_pow2(m)), 64)
    block_n = 32 if m <= 16 else 64
    block_k = 128
    tiles = div_ceil(m, block_m) * div_ceil(n, block_n)
    k_blocks = div_ceil(k, block_k)
    split = max(1, min(k_blocks // 2, div_ceil(sms, tiles)))
    return GemmConfig(block_m, block_n, block_k, split)


@direct_launch
@triton.jit
def _gemm_kernel(
    X,
    W,
    Y,
    R,
    Part,
    Counters,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    k_per_split,
    split,
    split_stride,
    HAS_SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    # row blocks vary fastest, so that the programs of one weight tile run side by side and the
    # tile comes from DRAM once, whatever the number of row blocks
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_start + rk)[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_start + rk)[None, :]
    m_ok = rm[:, None] < M
    n_ok = rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + rk)[None, :] < k_end
        x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_ptrs = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    r_ptrs = R + rm[:, None].to(tl.int64) * stride_rm + rn[None, :]
    if not HAS_SPLIT:
        if HAS_RES:  # the residual added to the float32 sums, rounded once (as cuBLAS's addmm does)
            acc += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        # a split's partials [M, N]; the workspace is under 2^31 floats
        offs = rm[:, None] * N + rn[None, :]
        tl.store(Part + pid_k * split_stride + offs, acc, mask=out_mask)
        # every thread's partial is written before the ticket is taken (the atomic releases them)
        tl.debug_barrier()
        tile = pid_n * tl.num_programs(0) + pid_m
        ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(split):
                total += tl.load(
                    Part + s * split_stride + offs, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            if HAS_RES:
                total += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")


@cache
def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # made on the first call, which the start-up warm-up makes before any graph is captured: under a
    # capture the counters' zeroing would be recorded, not run
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the split-K GEMM's workspace must be made before a CUDA graph is captured")
    part = torch.empty(_WORKSPACE_FLOATS, dtype=torch.float32, device=device)
    counters = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return part, counters


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the tests reach the ticket path
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_matmul(
    x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ w.T for w [N, K] (16-bit, contiguous rows), float32 sums, the output in x's dtype; with
    `residual` [M, N], residual + x @ w.T, the add on the float32 sums."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or choose_config(m, n, k, _sm_count(x.device))
    grid_n, grid_m = div_ceil(n, cfg.block_n), div_ceil(m, cfg.block_m)
    # each split a whole number of K blocks; a split with none left would never take its ticket
    k_per_split = div_ceil(div_ceil(k, cfg.split), cfg.block_k) * cfg.block_k
    split = div_ceil(k, k_per_split)
    part, counters = _workspace(x.device)
    if split > 1 and (split * m * n > part.numel() or grid_n * grid_m > counters.numel()):
        split, k_per_split = 1, k
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
    _gemm_kernel[(grid_m, grid_n, split)](
        x, w, y, residual if residual is not None else y, part, counters, m, n, k, x.stride(0), w.stride(0),
        y.stride(0), residual.stride(0) if residual is not None else 0, k_per_split, split, m * n,
        HAS_SPLIT=split > 1, HAS_RES=residual is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
