"""Causal attention of fresh prompts (no cached prefix) over their own K/V, read by the tensor memory accelerator.

Why: the extend kernel (`attention.py`) gathers every tile of keys through the page table, row by row, so on a
Hopper GPU its loads cannot use the copy engine, and it reaches a third to a half of the tensor cores' rate on
long prompts and less on a prefill step of many prompts (docs/benchmarks.md, "Prefill attention through torch's
kernels"). In a step whose requests are all fresh, each request's keys and values are also a run of rows of the
step's own q|k|v projection, rotated in place by the rotary kernel before it stored them into the pool; here the
tiles of queries, keys and values are boxes of those rows (host-made tensor descriptors over the q, k and v
columns), so that they come in through the copy engine, pipelined, and the products are warpgroup products.

Rows of a box past a request's end belong to the next request (or lie past the step's last row, read as zeros):
the causal mask drops such keys (a key past the request's end is past every one of its queries), and the queries
past it are never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from minisgl.kernel import dot_precision
from minisgl.kernel.attention import _LOG2E, _extend_tile
from minisgl.utils.misc import div_ceil


@dataclass(frozen=True)
class FreshConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


FRESH_CONFIG: FreshConfig | None = None  # set to force one tile configuration (benchmarks)
# measured on an H100 (docs/benchmarks.md, "Attention of fresh prompts through the tensor memory accelerator"):
# 64 x 64 tiles in 4 warps and 3 stages fastest on prefill steps of prompts up to 8,192 tokens (the workload's step
# 0.185 -> 0.134 ms a layer against the extend kernel), 128 x 128 in 8 warps from 8,192 (one prompt of 32,768:
# 11.5 -> 7.6 ms, 577 TFLOP/s)
DEFAULT = FreshConfig(64, 64, 4, 3)
LONG = FreshConfig(128, 128, 8, 3)
LONG_QUERIES = 8192
# a float32 query (tests, the interpreter) keeps its tiles within shared memory
FLOAT32 = FreshConfig(64, 32, 4, 2)


def fresh_config(q_dtype: torch.dtype, max_q_len: int) -> FreshConfig:
    if FRESH_CONFIG is not None:
        return FRESH_CONFIG
    if q_dtype == torch.float32:
        return FLOAT32
    return LONG if max_q_len >= LONG_QUERIES else DEFAULT


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q, k, v [T, H, D] can be read as boxes of 2-D rows: the heads of a token one run of elements,
    16-byte aligned rows, and a head size the boxes take (a power of two of 16-256 elements)."""
    d = q.shape[-1]
    if d & (d - 1) or not 16 <= d <= 256:
        return False
    align = 16 // q.element_size()
    for t in (q, k, v):
        if t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != d or t.stride(0) % align:
            return False
        if t.data_ptr() % 16:
            return False
    return True


def _rows(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """t [T, H, D] as a descriptor over its [T, H * D] rows, boxes of `block`."""
    n, h, d = t.shape
    return TensorDescriptor(t, [n, h * d], [t.stride(0), 1], block)


# launched through Triton's own path: its descriptors are built by Triton's launcher (a prefill step's 28
# launches, where the direct path's saving is nothing to speak of)
@triton.jit
def _fresh_kernel(
    q_desc,
    k_desc,
    v_desc,
    Out,
    QStarts,
    QLens,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # the query blocks launched last first: under the causal mask a block's work grows with its index
    mblk = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_len = tl.load(QLens + b)
    if mblk * BLOCK_M >= q_len:
        return
    q_start = tl.load(QStarts + b)
    kvh = h // GROUP
    q = q_desc.load([q_start + mblk * BLOCK_M, h * D])
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # the keys before the block's first query: every query of the block sees them, no mask
    full_end = (mblk * BLOCK_M // BLOCK_N) * BLOCK_N
    for n in tl.range(0, full_end, BLOCK_N, num_stages=STAGES):
        k = k_desc.load([q_start + n, kvh * D])
        v = v_desc.load([q_start + n, kvh * D])
        offs_n = n + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _extend_tile(
            q, k, v, m_i, l_i, acc, qk_scale, offs_n, offs_m, q_len, False, PRECISION
        )
    # the diagonal tiles: the causal mask, and the request's end
    end = tl.minimum(q_len, (mblk + 1) * BLOCK_M)
    for n in tl.range(full_end, end, BLOCK_N):
        k = k_desc.load([q_start + n, kvh * D])
        v = v_desc.load([q_start + n, kvh * D])
        offs_n = n + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _extend_tile(q, k, v, m_i, l_i, acc, qk_scale, offs_n, offs_m, q_len, True, PRECISION)
    out = acc / l_i[:, None]
    d = tl.arange(0, D)
    o_ptr = Out + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def fresh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of packed fresh prompts over their own keys: q [T, Hq, D], k and v [T, Hk, D] (the step's
    rotated projections, `takes` true), q_starts and q_lens [B] int32 -> [T, Hq, D]."""
    t, hq, d = q.shape
    hk = k.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    cfg = fresh_config(q.dtype, max_q_len)
    _fresh_kernel[(div_ceil(max_q_len, cfg.block_m), hq, q_lens.shape[0])](
        _rows(q, [cfg.block_m, d]),
        _rows(k, [cfg.block_n, d]),
        _rows(v, [cfg.block_n, d]),
        out,
        q_starts,
        q_lens,
        out.stride(0),
        out.stride(1),
        sm_scale * _LOG2E,
        GROUP=hq // hk,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        D=d,
        STAGES=cfg.num_stages,
        PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
