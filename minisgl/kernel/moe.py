"""The fused MoE: grouped GEMMs over the (token, expert) pairs sorted by expert.

Each token picks top_k experts, giving T * top_k pairs numbered t * top_k + j. `align_block_size` sorts
the pairs by expert and pads each expert's run to a multiple of BLOCK_M, so every row block of the
grouped GEMM belongs to one expert: a program loads that expert's weights once for all the block's
rows. Two launches of one kernel do the work: gate|up over the tokens, then (after silu * up) down
over the pairs with the routing weights applied; the top_k rows of each token are summed at the end.
Sizes come from bounds known on the host, never from the routing, so CUDA graphs can capture it all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.kernel import dot_precision
from minisgl.kernel.activation import silu_and_mul
from minisgl.kernel.launch import direct_launch
from minisgl.utils.misc import div_ceil


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    # row blocks about as tall as an expert's share of the pairs: decode gives each expert a few rows,
    # and a tall block would be mostly padding
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    # float32 tiles take twice the shared memory of 16-bit ones
    block_k = 32 if dtype == torch.float32 else 64
    return MoeConfig(block_m, 64, block_k, num_warps=4, num_stages=3)


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_ids [num_blocks * block_m] int32: pair numbers, T * top_k where padding;
    expert_ids [num_blocks] int32: the expert of each row block; num_padded [1] int32: how many
    of sorted_ids are used (blocks from there on are skipped).
    """
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    # the k-th pair of expert e goes to (start of e's padded run) + k
    first = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first[experts]
    dest = (ends - padded)[experts] + rank
    # each expert with pairs pads at most one block, so this bounds sum(padded) / block_m
    num_blocks = num_pairs // block_m + min(num_pairs, num_experts)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_max(num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


# the pair count changes with every batch: unspecialised, one compiled kernel serves them all
@direct_launch
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    A,
    B,
    C,
    TopkWeights,
    SortedIds,
    ExpertIds,
    NumPadded,
    N,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    K: tl.constexpr,
    PAIRS_PER_ROW: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair, :] = A[pair // PAIRS_PER_ROW, :] @ B[expert]^T (times the pair's routing weight)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    a_rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = B + expert * stride_be + cols[None, :] * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHTS:
        acc = acc * tl.load(TopkWeights + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    pairs_per_row: int,
    cfg: MoeConfig,
) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel(), div_ceil(n, cfg.block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights if topk_weights is not None else c,
        sorted_ids,
        expert_ids,
        num_padded,
        n,
        c.shape[0],
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        # a model has two: hidden and the local intermediate size
        K=k,
        PAIRS_PER_ROW=pairs_per_row,
        MUL_WEIGHTS=topk_weights is not None,
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; topk_weights/ids: [T, k] -> [T, H] (see BaseMoeBackend)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    # the kernel reads rows with unit stride along K
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    cfg = moe_config(num_pairs, num_experts, x.dtype)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, num_experts, cfg.block_m)
    h = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, None, sorted_ids, expert_ids, num_padded, top_k, cfg)
    act = silu_and_mul(h)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    _grouped_gemm(act, down, y, weights, sorted_ids, expert_ids, num_padded, 1, cfg)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
