"""Prefill attention by cuDNN's flash kernel (through torch): each request's context copied out of the pool, then
one call over the packed requests.

The extend kernel (attention.py) reads K/V through the page table a tile at a time, which rules out the tensor
memory accelerator; on the same work cuDNN's kernel, reading contiguous K/V, is 1.6-1.7x faster on an H100 (torch's
own flash kernel is not faster than the extend kernel there; docs/benchmarks.md). A prefill step with many queries
a context token is bound by FLOPs, not bytes, so copying each request's K/V out of the pool (its context's bytes,
read once and written once) and calling cuDNN costs less than the paged kernel's slower products. A step of few
queries over a long cached context is bound by reading that context, and the copy would triple it: there the
extend kernel stays (`worth_it`). What cuDNN gets right on this machine (query groups, queries after a cached
prefix) is asked once a process (`probe`); what it does not, the path leaves to the extend kernel.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

FLASH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class FlashExtend:
    """A prefill step's varlen arguments: each request's context slots in order, and the cumulative lengths."""

    slots: (
        torch.Tensor
    )  # [total context tokens] int32: the pool slot of each context token, request by request
    cu_q: torch.Tensor  # [B + 1] int32: where each request's queries start in the packed q, and the total
    cu_k: torch.Tensor  # [B + 1] int32: the same for the gathered contexts
    max_q: int
    max_k: int
    heads: torch.Tensor | None = (
        None  # [Hq] the KV head of each query head, where K/V are repeated to q's heads
    )


# the copied K/V of a step's contexts, a layer at a time: beside the KV pool, which takes most of the free memory
MAX_COPY_BYTES = 256 << 20


def worth_it(
    q_lens: list[int], seq_lens: list[int], min_queries: int, max_context: int, prefix: bool = True
) -> bool:
    """Whether the flash path is worth its copy: the step's queries a context token, weighted by the context
    (query-key pairs over context tokens: the FLOPs a byte of K/V up to a constant), at least `min_queries`, and
    its contexts' K/V within the copy's room (`max_context` tokens); without `prefix`, only fresh prompts."""
    if min_queries <= 0 or (not prefix and q_lens != seq_lens):
        return False
    context = sum(seq_lens)
    pairs = sum(m * (n - m) + m * (m + 1) // 2 for m, n in zip(q_lens, seq_lens))
    return context <= max_context and pairs >= min_queries * context


@dataclass(frozen=True)
class FlashSupport:
    """What cuDNN's kernel does right here, found by `probe` against float32 attention."""

    gqa: bool  # K/V with fewer heads than q (else they are repeated to q's heads on the way out of the pool)
    prefix: bool  # queries aligned to the end of a longer context (else only steps of fresh prompts take the path)


@functools.cache
def probe(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> FlashSupport | None:
    """Whether torch's cuDNN attention runs here for this dtype, head dim and query group, and what it gets right:
    asked once a process with tiny calls, so that a build or GPU without it keeps the extend kernel."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES or head_dim % 8 or head_dim > 256:
        return None
    g = torch.Generator(device=device).manual_seed(0)

    def agrees(q_lens: list[int], k_lens: list[int], gqa: bool) -> bool:
        hk = 2
        q = torch.randn(sum(q_lens), hk * group, head_dim, device=device, generator=g).to(dtype)
        k = torch.randn(sum(k_lens), hk, head_dim, device=device, generator=g).to(dtype)
        v = torch.randn_like(k)
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device=device)
        kk, vv = (k, v) if gqa else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        out = _cudnn(q, kk, vv, cu_q, cu_k, max(q_lens), max(k_lens), head_dim**-0.5).float()
        ref = torch.cat([_reference(q, k, v, cu_q, cu_k, i, group) for i in range(len(q_lens))])
        return bool((out - ref).norm() <= 2e-2 * ref.norm())

    try:
        gqa = group == 1 or agrees([5, 3], [5, 3], gqa=True)
        if not (gqa or agrees([5, 3], [5, 3], gqa=False)):
            raise RuntimeError("its output differs from attention computed in float32")
        return FlashSupport(gqa, agrees([2, 3], [6, 3], gqa))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        logger.warning(f"torch's cuDNN attention is not available ({e}): prefill keeps the extend kernel")
        return None


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    i: int,
    group: int,
) -> torch.Tensor:
    """float32 causal attention of request i's queries, aligned to the end of its context."""
    qi = q[int(cu_q[i]) : int(cu_q[i + 1])].float()
    ki = k[int(cu_k[i]) : int(cu_k[i + 1])].float().repeat_interleave(group, 1)
    vi = v[int(cu_k[i]) : int(cu_k[i + 1])].float().repeat_interleave(group, 1)
    m, n = qi.shape[0], ki.shape[0]
    scores = torch.einsum("qhd,khd->hqk", qi, ki) * qi.shape[-1] ** -0.5
    mask = torch.arange(n, device=q.device)[None, :] > torch.arange(n - m, n, device=q.device)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), vi)


def _cudnn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """cuDNN's flash attention over packed (ragged) requests, causal; [T, H, D] in, [T, Hq, D] out."""
    out = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, True, False, scale=scale
    )
    return out[0]


def context_slots(
    page_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, cu_k: torch.Tensor, total: int
) -> torch.Tensor:
    """The pool slot of every context token of a step, request by request, found on the device (no sync)."""
    device = rows.device
    req = torch.repeat_interleave(
        torch.arange(rows.shape[0], device=device), seq_lens.long(), output_size=total
    )
    pos = torch.arange(total, device=device) - cu_k[req].long()
    return page_table[rows[req].long(), pos]


def flash_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: FlashExtend,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their request's whole context, as extend_attention computes it.

    q: [T, Hq, D] packed by request (bf16 or fp16); this step's K/V must already be in the pool. -> [T, Hq, D]
    An FP8 pool's rows are widened to q's dtype and scaled by the layer's scales on the way out of the pool.
    """
    if meta.heads is not None:  # each query head's K/V row, where the kernel takes no groups
        k = k_cache[meta.slots[:, None], meta.heads[None, :]]
        v = v_cache[meta.slots[:, None], meta.heads[None, :]]
    else:
        k = k_cache.index_select(0, meta.slots)
        v = v_cache.index_select(0, meta.slots)
    if k.dtype != q.dtype:  # FP8: what the extend kernel reads, K and V times their scales
        assert k_scale is not None and v_scale is not None, "an FP8 pool needs the layer's scales"
        k = k.to(q.dtype).mul_(k_scale)
        v = v.to(q.dtype).mul_(v_scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _cudnn(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale)
