"""Paged attention over the KV pool: a split-KV decode kernel and a causal extend (prefill) kernel.

The pool is indexed by token slot: page_table[row, pos] holds the slot of position pos of the request
in that row, so both kernels gather K/V rows through the page table and work for any page size.
Decode reads each K/V row once for all the query heads that share it (GQA), and splits long
contexts along the sequence so that small batches still fill the GPU; a second kernel merges the
splits by their log-sum-exp. Both kernels read an FP8 pool directly: its tiles are widened in
registers (to fp16, or float32 for a float32 query) and the layer's scales multiply the scores and the
outputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minisgl.kernel import dot_precision
from minisgl.kernel.launch import direct_launch, wait_for_inputs
from minisgl.kernel.norm import row_inv_rms
from minisgl.kernel.store import check_fp8_pool, to_pool
from minisgl.kvcache.mha_pool import FP8_MAX
from minisgl.utils.misc import div_ceil, next_pow2

if TYPE_CHECKING:
    from minisgl.attention.base import DecodeRope

_LOG2E = 1.4426950408889634


@dataclass
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int
    # full tiles loaded without masks, only a split's last tile masked: the loads then depend on nothing
    # but the page table, and the pipeline keeps more of them in flight (16-bit queries only)
    even: bool = False
    # registers a thread at most (ptxas's .maxnreg; None: the compiler's choice), which sets how many
    # programs an SM holds: 65,536 registers over num_warps * 32 threads
    maxnreg: int | None = None


# measured on an H200 (docs/benchmarks.md, "Decode attention: unmasked full tiles"): wide masked tiles once
# a bf16 batch alone fills the GPU; below that, and always for an FP8 pool, unmasked full tiles of 128
# keys with a deeper pipeline; a float32 query keeps the small masked tiles its shared memory allows
WIDE, DEEP = DecodeConfig(128, 4, 2), DecodeConfig(64, 4, 3)
# the FP8 kernel waits on its warps' latency, not on DRAM (docs/benchmarks.md, "Decode attention under Nsight
# Compute"): left alone ptxas gives it 177 registers, two programs an SM; at 168 (no spills) three fit
EVEN_DEEP, EVEN_FP8 = DecodeConfig(128, 4, 3, True), DecodeConfig(128, 4, 4, True, 168)
DECODE_CONFIG: DecodeConfig | None = None  # set to force one tile configuration (benchmarks)
WIDE_PROGRAMS = 1024  # programs (requests x KV heads) from which a 16-bit batch takes the wide tiles
MAX_SPLITS = 16
TARGET_PROGRAMS = 264  # about two programs per SM on an H200


def decode_config(
    batch_size: int, num_kv_heads: int, q_dtype: torch.dtype = torch.bfloat16, fp8: bool = False
) -> DecodeConfig:
    if DECODE_CONFIG is not None:
        return DECODE_CONFIG
    if q_dtype == torch.float32:
        return WIDE if batch_size * num_kv_heads >= WIDE_PROGRAMS else DEEP
    if fp8:
        return EVEN_FP8
    return WIDE if batch_size * num_kv_heads >= WIDE_PROGRAMS else EVEN_DEEP


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # the keys every query of a block sees (before its first query) loaded without masks, only the diagonal
    # tiles masked: the loads then depend on nothing but the page table (BLOCK_D == D only)
    even: bool = False
    # the query blocks of a request launched last first: under the causal mask a block's work grows with its
    # index, so the longest programs start first and the short ones fill the tail
    longest_first: bool = False


EXTEND_CONFIG: ExtendConfig | None = None  # set to force one tile configuration (benchmarks)


# measured on an H200 (docs/benchmarks.md, "Prefill attention's tiles"): 128 x 128 tiles in three stages, the
# longest query blocks first, 8-17% faster than 128 x 64 in two on long prompts, on a long prompt's last chunk
# and on the workload's prefill step. Compiled for sm_90 they take 164 KB of shared memory and 254 registers a
# thread; they are taken only where a program may have 200 KB (Hopper's 227 KB), the GPUs they were measured on
LARGE = ExtendConfig(128, 128, 8, 3, longest_first=True)
SMALL = ExtendConfig(128, 64, 8, 2)
LARGE_SHARED_BYTES = 200 * 1024
# a step whose requests have at most SHORT_QUERIES new tokens each (a burst of short chat prompts, a chat turn
# after a cached prefix) fills a 128-row query tile mostly with padding, one program an SM: smaller tiles, several
# programs an SM, 1.3-3x faster on such steps on an H100, level on the workload's prefill step (docs/benchmarks.md,
# "Prefill attention's tiles for short prompts")
SHORT = ExtendConfig(64, 32, 4, 3)
SHORT_QUERIES = 128


@functools.cache
def _shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on this GPU, as Triton checks it (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def extend_config(q_dtype: torch.dtype, block_d: int, device: torch.device, max_q_len: int) -> ExtendConfig:
    if EXTEND_CONFIG is not None:
        return EXTEND_CONFIG
    if q_dtype == torch.float32 or block_d > 128:  # keep the tiles within shared memory
        return ExtendConfig(64, 32, 4, 2)
    if max_q_len <= SHORT_QUERIES:
        return SHORT
    return LARGE if _shared_bytes(device) >= LARGE_SHARED_BYTES else SMALL


@triton.jit
def _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, nmask, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys into the online softmax of the query heads: the new (max, sum, weighted V)."""
    if k.dtype != q.dtype:  # an FP8 pool's tile, widened in registers
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    return _online_softmax(qk, v, m_i, l_i, acc, PRECISION)


@triton.jit
def _online_softmax(qk, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Scores of one tile of keys (masked ones -inf) into the running (max, sum, weighted V) of their rows."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rope_heads(
    X, W, eps, mask, d, cos, sin, scale, S, b, stride_s, s_eps, D: tl.constexpr, NORM: tl.constexpr,
    SCALE: tl.constexpr, READ: tl.constexpr, S_N: tl.constexpr, S_BLOCK: tl.constexpr,
):  # fmt: skip
    """Heads at X (pointers [R, D] of one token), scaled (SCALE: a folded norm's 1 / rms of row b of S, read
    here with READ, else `scale`), RMS-normalised (NORM) and rotated, rounded where the rotary kernel
    (rotary.py's _rotate) rounds: ([R, D] in X's dtype, the scale). The rotate-half partner of dim d is
    d +- D/2, loaded a second time rather than moved between registers."""
    partner = (d + D // 2) % D
    x = tl.load(X + d[None, :], mask=mask, other=0.0)
    xp = tl.load(X + partner[None, :], mask=mask, other=0.0)
    if SCALE:
        if READ:  # after the heads' loads are issued, so that both reads are in flight together
            scale = row_inv_rms(S, b, stride_s, s_eps, S_N, S_BLOCK)
        x = (x.to(tl.float32) * scale).to(x.dtype)
        xp = (xp.to(tl.float32) * scale).to(xp.dtype)
    if NORM:
        f, fp = x.to(tl.float32), xp.to(tl.float32)
        inv = tl.rsqrt(tl.sum(f * f, 1) / D + eps)[:, None]
        w = tl.load(W + d).to(tl.float32)[None, :]
        wp = tl.load(W + partner).to(tl.float32)[None, :]
        x = ((f * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype)
        xp = ((fp * inv).to(xp.dtype).to(tl.float32) * wp).to(xp.dtype)
    c = cos.to(x.dtype).to(tl.float32)[None, :]
    s = sin.to(x.dtype).to(tl.float32)[None, :]
    sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
    return (x.to(tl.float32) * c + sign * (xp.to(tl.float32) * s)).to(x.dtype), scale


@direct_launch
@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    MidO,
    MidLse,
    PageTable,
    Rows,
    SeqLens,
    Order,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pt,
    stride_ot,
    stride_oh,
    num_splits,
    qk_scale,
    KNew,
    VNew,
    Pos,
    CosSin,
    QW,
    KW,
    Loc,
    eps,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cs,
    S,
    s_eps,
    stride_s,
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    EVEN: tl.constexpr,
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    ORDERED: tl.constexpr,
    SCALE: tl.constexpr,
    S_N: tl.constexpr,
    S_BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    # KV heads vary fastest across programs: the heads of one token share DRAM pages and are read together
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    if ORDERED:  # the requests longest first: the last programs to start are the shortest
        b = tl.load(Order + b)
    s = tl.program_id(2)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h
    hmask = h < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    if ROPE:  # BLOCK_D == D: q comes unrotated, and this program rotates its heads (every split alike)
        pos = tl.load(Pos + b).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + d)
        sin = tl.load(CosSin + pos * stride_cs + D + d)
        # SCALE: q|k|v came from the hidden states S unnormalised (the norm's weight folded into q|k|v)
        q, scale = _rope_heads(
            Q + b * stride_qt + heads[:, None] * stride_qh, QW, eps, hmask[:, None], d, cos, sin, 1.0, S, b,
            stride_s, s_eps, D, NORM, SCALE, True, S_N, S_BLOCK,
        )  # fmt: skip
    else:
        q_ptr = Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=hmask[:, None] & dmask[None, :], other=0.0)
    if HALF:
        # e4m3 widens to fp16 exactly, one instruction a pair (to bf16 it takes several): a bf16 query
        # joins it in fp16, whose range it fits once clamped and whose mantissa holds it whole
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if FP8:
        # an FP8 pool holds K / k_scale and V / v_scale: the scales multiply the scores and the output,
        # so the tiles are only widened to q's dtype in registers and never scaled element by element
        qk_scale = qk_scale * tl.load(KScale)
    # the keys read from the pool; with ROPE the new token (position seq_len - 1) is not there yet
    pool_end = end
    if ROPE:
        pool_end = tl.minimum(end, seq_len - 1)
    tail = start
    if EVEN:  # BLOCK_D == D: every full tile without a mask, then at most one masked tile
        tail = start + tl.maximum(pool_end - start, 0) // BLOCK_N * BLOCK_N
        for n in range(start, tail, BLOCK_N):
            offs = n + tl.arange(0, BLOCK_N)
            slots = tl.load(PageTable + row * stride_pt + offs).to(tl.int64)
            # K and V share one layout: one tile of offsets (int64 a element, registers) serves both
            at = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
            k = tl.load(K + at)
            v = tl.load(V + at)
            m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, offs < end, False, PRECISION)
    for n in range(tail, pool_end, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < pool_end
        slots = tl.load(PageTable + row * stride_pt + offs, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        at = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(K + at, mask=kv_mask, other=0.0)
        v = tl.load(V + at, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, nmask, True, PRECISION)
    if ROPE:
        if (start <= seq_len - 1) & (seq_len - 1 < end):  # the split that holds the new token
            one = tl.full([1], 1, tl.int1)
            k_new, _ = _rope_heads(
                KNew + b * stride_knt + kvh * stride_knh, KW, eps, one[:, None], d, cos, sin, scale, S, b,
                stride_s, s_eps, D, NORM, SCALE, False, S_N, S_BLOCK,
            )  # fmt: skip
            v_new = tl.load(VNew + b * stride_vnt + kvh * stride_vnh + d)[None, :]
            if SCALE:
                v_new = (v_new.to(tl.float32) * scale).to(v_new.dtype)
            # stored as the rotary kernel stores them, and attended to as the pool will hand them out
            k_pool = to_pool(k_new, KScale, K, FP8, FP8_LIMIT)
            v_pool = to_pool(v_new, VScale, V, FP8, FP8_LIMIT)
            dst = tl.load(Loc + b).to(tl.int64) * stride_kt + kvh * stride_kh + d[None, :]
            tl.store(K + dst, k_pool)
            tl.store(V + dst, v_pool)
            kf = k_pool.to(q.dtype).to(tl.float32)
            vf = v_pool.to(q.dtype).to(tl.float32)
            score = tl.sum(q.to(tl.float32) * kf, 1) * qk_scale
            m_new = tl.maximum(m_i, score)
            p = tl.exp2(score - m_new)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + p
            # p rounded to V's dtype, as the tiles' P x V product takes it
            acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * vf
            m_i = m_new

    omask = hmask[:, None] & dmask[None, :]
    if SPLIT:
        # an empty split (a short context) leaves weight 0 for the merge: lse = -inf, output 0
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        if FP8:
            out = out * tl.load(VScale)
        lse = m_i + tl.log2(l_i)
        base = (b * NUM_QO_HEADS + heads) * num_splits + s
        tl.store(MidO + base[:, None] * BLOCK_D + d[None, :], out, mask=omask)
        tl.store(MidLse + base, lse, mask=hmask)
    else:
        out = acc / l_i[:, None]
        if FP8:
            out = out * tl.load(VScale)
        tl.store(
            Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=omask,
        )


@direct_launch
@triton.jit
def _decode_merge_kernel(
    MidO,
    MidLse,
    Out,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_QO_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    base = (b * NUM_QO_HEADS + h) * num_splits + s
    lse = tl.load(MidLse + base, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(smask, w, 0.0)
    o = tl.load(MidO + base[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def ordered_from(batch_size: int, order_from: int) -> bool:
    """Whether a decode batch of `batch_size` rows starts longest first when batches of `order_from` rows
    or more do (MINISGL_DECODE_LONGEST_FIRST; 0: never)."""
    return 0 < order_from <= batch_size


def decode_order(seq_lens: list[int]) -> list[int]:
    """The batch's indices by context length, longest first (ties in batch order): `decode_attention`'s order."""
    # a stable sort keeps ties in batch order with reverse too; 12 us for 256 requests on a 2 GHz core
    return sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)


def decode_splits(batch_size: int, num_kv_heads: int) -> int:
    """Splits along the sequence: enough programs to fill the GPU when the batch alone does not."""
    want = div_ceil(TARGET_PROGRAMS, max(1, batch_size * num_kv_heads))
    return max(1, min(MAX_SPLITS, want))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request. q: [B, Hq, D]; k/v_cache: [slots, Hk, D]; rows, seq_lens: [B] -> [B, Hq, D].

    `order` ([B] int32, a permutation of the batch) is the order in which the requests' programs start:
    longest context first (`decode_order`), so that on uneven contexts the last wave holds short
    programs, not a long one that starts late.

    An FP8 (float8_e4m3fn) pool is read as stored * scale, with k_scale and v_scale one-element float32
    tensors; q then stays in its own dtype (the products run in fp16 for a bf16 or fp16 q, in float32
    for a float32 one). With `rope`, q is unrotated and this step's K/V are not in the pool yet: the
    kernel rotates q and K (after Qwen3's q/k norm) and stores K and V, as the rotary kernel would have,
    q, K and V first scaled by the row's 1 / rms where `rope.row_scale` is given (a folded norm).
    """
    fp8 = check_fp8_pool(k_cache, k_scale, v_scale)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention reads K and V at the same offsets: the caches must share a layout")
    bs, hq, d = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    cfg = decode_config(bs, hk, q.dtype, fp8)
    out = torch.empty((bs, hq, d), dtype=q.dtype, device=q.device)
    block_d = max(16, next_pow2(d))  # tl.dot wants K >= 16
    if rope is not None:
        if block_d != d or q.stride(-1) != 1 or rope.k.stride(-1) != 1 or rope.v.stride(-1) != 1:
            raise ValueError(
                "the rotary inside decode attention needs a power-of-2 head dim of contiguous rows"
            )
        if (rope.q_weight is None) != (rope.k_weight is None):
            raise ValueError("the q/k norm inside decode attention needs both weights")
    norm = rope is not None and rope.q_weight is not None
    scaled = rope if rope is not None and rope.row_scale is not None else None
    split = num_splits > 1
    if split:
        mid_o = torch.empty((bs, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bs, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out
    _decode_kernel[(hk, bs, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        mid_o,
        mid_lse,
        page_table,
        rows,
        seq_lens,
        order if order is not None else seq_lens,
        k_scale if fp8 else seq_lens,
        v_scale if fp8 else seq_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        num_splits,
        sm_scale * _LOG2E,
        # unused pointer arguments get a tensor that is there: a variant without ROPE never reads them
        rope.k if rope else q,
        rope.v if rope else q,
        rope.positions if rope else seq_lens,
        rope.cos_sin if rope else q,
        rope.q_weight if norm else q,
        rope.k_weight if norm else q,
        rope.loc if rope else seq_lens,
        rope.eps if rope else 0.0,
        rope.k.stride(0) if rope else 0,
        rope.k.stride(1) if rope else 0,
        rope.v.stride(0) if rope else 0,
        rope.v.stride(1) if rope else 0,
        rope.cos_sin.stride(0) if rope else 0,
        scaled.row_scale[0] if scaled else q,
        scaled.row_scale[1] if scaled else 0.0,
        scaled.row_scale[0].stride(0) if scaled else 0,
        NUM_QO_HEADS=hq,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=cfg.block_n,
        D=d,
        BLOCK_D=block_d,
        SPLIT=split,
        PRECISION=dot_precision(q.dtype),
        FP8=fp8,
        HALF=fp8 and q.dtype != torch.float32,
        EVEN=cfg.even and block_d == d,
        ROPE=rope is not None,
        NORM=norm,
        FP8_LIMIT=FP8_MAX,
        ORDERED=order is not None,
        SCALE=scaled is not None,
        S_N=scaled.row_scale[0].shape[-1] if scaled else 1,
        S_BLOCK=next_pow2(scaled.row_scale[0].shape[-1]) if scaled else 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if split:
        _decode_merge_kernel[(bs, hq)](
            mid_o,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_QO_HEADS=hq,
            D=d,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(num_splits),
            num_warps=4,
        )
    return out


@triton.jit
def _extend_tile(q, k, v, m_i, l_i, acc, qk_scale, offs_n, q_pos, end, CAUSAL, PRECISION: tl.constexpr):
    """One tile of keys into the queries' online softmax; CAUSAL: the tile reaches the block's diagonal
    or the context's end, so the causal mask and the bound apply."""
    if k.dtype != q.dtype:  # an FP8 pool's tile, widened in registers
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if CAUSAL:
        causal = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < end)[None, :]
        qk = tl.where(causal, qk, float("-inf"))
    return _online_softmax(qk, v, m_i, l_i, acc, PRECISION)


@direct_launch
@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    Rows,
    SeqLens,
    QStarts,
    QLens,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    EVEN: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
):
    mblk = tl.program_id(0)
    if LONGEST_FIRST:
        mblk = tl.num_programs(0) - 1 - mblk
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_len = tl.load(QLens + b)
    if mblk * BLOCK_M >= q_len:
        return
    q_start = tl.load(QStarts + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(Rows + b).to(tl.int64)
    prefix = seq_len - q_len  # the cached part: this step's queries sit at positions prefix ... seq_len - 1
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_ptr = Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=mmask[:, None] & dmask[None, :], other=0.0)
    if HALF:
        # e4m3 widens to fp16 exactly, one instruction a pair (to bf16 it takes several): a bf16 query
        # joins it in fp16, whose range it fits once clamped and whose mantissa holds it whole
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if FP8:
        # as in decode: the scales multiply the scores and the output, the tiles are only widened
        qk_scale = qk_scale * tl.load(KScale)

    # keys before the block's first query are visible to all of its queries: no mask there
    full_end = ((prefix + mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
    end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    start = 0
    if EVEN:  # BLOCK_D == D: the tiles below full_end without a mask, then the diagonal ones masked
        for n in range(0, full_end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            slots = tl.load(PageTable + row * stride_pt + offs_n).to(tl.int64)
            k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + d[None, :])
            v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + d[None, :])
            m_i, l_i, acc = _extend_tile(
                q, k, v, m_i, l_i, acc, qk_scale, offs_n, q_pos, end, False, PRECISION
            )
        start = full_end
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        slots = tl.load(PageTable + row * stride_pt + offs_n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _extend_tile(
            q, k, v, m_i, l_i, acc, qk_scale, offs_n, q_pos, end, n + BLOCK_N > full_end, PRECISION
        )

    out = acc / l_i[:, None]
    if FP8:
        out = out * tl.load(VScale)
    o_ptr = Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their request's whole context (cached prefix + this step).

    q: [T, Hq, D] packed by request; this step's K/V must already be in the pool. -> [T, Hq, D]
    An FP8 pool is read as in decode_attention.
    """
    fp8 = check_fp8_pool(k_cache, k_scale, v_scale)
    t, hq, d = q.shape
    hk = k_cache.shape[1]
    bs = rows.shape[0]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block_d = max(16, next_pow2(d))  # tl.dot wants K >= 16
    cfg = extend_config(q.dtype, block_d, q.device, max_q_len)
    _extend_kernel[(div_ceil(max_q_len, cfg.block_m), hq, bs)](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        rows,
        seq_lens,
        q_starts,
        q_lens,
        k_scale if fp8 else q_lens,
        v_scale if fp8 else q_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        sm_scale * _LOG2E,
        GROUP=hq // hk,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        D=d,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        FP8=fp8,
        HALF=fp8 and q.dtype != torch.float32,
        EVEN=cfg.even and block_d == d,
        LONGEST_FIRST=cfg.longest_first,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
