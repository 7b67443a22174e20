"""The LM head and temperature sampling in one kernel: each program multiplies a tile of rows by a tile of the
vocabulary's weight rows and keeps, for each row, the tile's best noisy score and its token; a merge then picks
each row's winner among the tiles.

The engine's plain path writes a step's logits in float32 (155 MB at 256 rows of a 151,936-token vocabulary)
and the sampling kernel reads them back: here they never leave the registers. The score is the sampling
kernel's (`kernel/sampling.py`): l / T in base 2 less log2(-log2 u), u the same splitmix64 hash of (seed, step,
token), greedy rows (T <= 0) the logit itself, ties to the lowest token id. The logits are this kernel's
float32 sums, whose order differs from cuBLAS's, so a row whose two best scores lie within a few float32 ulps
may pick the other token; nothing else differs.

Only rows that sample from the whole vocabulary at a temperature (or greedily) come here: filters, penalties,
biases, masks and logprobs need the logits themselves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minisgl.kernel import dot_precision
from minisgl.kernel.launch import direct_launch
from minisgl.kernel.sampling import _hash_uniform, _log2
from minisgl.utils.misc import div_ceil, next_pow2


class LMSampleConfig(NamedTuple):
    rows: int  # rows of hidden states a program (16 at least: tl.dot's smallest)
    cols: int  # vocabulary entries a program
    depth: int  # K a step of the product's loop
    warps: int
    stages: int


# the first batch size of each band of default_config's tiles (the warm-up compiles one of each)
BANDS = (1, 17, 65)


def default_config(bs: int) -> LMSampleConfig:
    """A tile for `bs` rows: the sweep's fastest on an H100 for both vocabularies it measured, or within 2% of
    it (benchmark/offline/lm_sample.py). Above 128 rows the LM head's FLOPs weigh more than the logits'
    bytes, and cuBLAS's product then the sampling kernel are as fast (256 rows) or faster."""
    if bs < BANDS[1]:
        return LMSampleConfig(16, 64, 128, 4, 4)
    if bs < BANDS[2]:
        return LMSampleConfig(64, 64, 64, 4, 3)
    return LMSampleConfig(64, 128, 64, 8, 4)


# the row count and the per-row arguments unspecialised: any batch, wherever its arguments lie, takes the
# variant the warm-up compiled for its band
@direct_launch
@triton.jit(do_not_specialize=["B", "Temps", "Seeds", "Steps"])
def _lm_head_sample_kernel(
    Hidden,
    stride_h,
    Weight,
    stride_w,
    Temps,
    Seeds,
    Steps,
    BestV,
    BestI,
    B,
    V,
    K,
    NUM_TILES,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    # the row tile varies fastest, so that the programs sharing a weight tile run side by side and it comes
    # from DRAM once
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < B
    col_ok = cols < V
    h_ptr = Hidden + rows[:, None] * stride_h + ks[None, :]
    w_ptr = Weight + cols[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptr + k, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + k, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k + ks) < K
            h = tl.load(h_ptr + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)

    temp = tl.load(Temps + rows, mask=row_ok, other=1.0)
    greedy = temp <= 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    # the rows' part of the hash as sampling.py's _hash_base computes it (masked: the tile's rows past B), then
    # each token's
    seed = tl.load(Seeds + rows, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
    step = tl.load(Steps + rows, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
    base = seed * 0x9E3779B97F4A7C15 + step * 0x94D049BB133111EB
    u = _hash_uniform(base[:, None], cols[None, :])
    scaled = tl.div_rn(acc, safe_temp[:, None])
    noisy = scaled * 1.4426950408889634 - _log2(-_log2(u, FAST_LOG), FAST_LOG)
    score = tl.where(greedy[:, None], acc, noisy)
    score = tl.where(col_ok[None, :], score, float("-inf"))
    top = tl.max(score, 1)
    # the lowest token among the tile's maxima, as torch.argmax picks the first
    best = tl.min(tl.where(score == top[:, None], cols[None, :], V), 1)
    tl.store(BestV + rows * NUM_TILES + pid_n, top, mask=row_ok)
    tl.store(BestI + rows * NUM_TILES + pid_n, best, mask=row_ok)


@direct_launch
@triton.jit
def _merge_kernel(BestV, BestI, Out, V, NUM_TILES, WIDTH: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, WIDTH)
    ok = c < NUM_TILES
    v = tl.load(BestV + r * NUM_TILES + c, mask=ok, other=float("-inf"))
    i = tl.load(BestI + r * NUM_TILES + c, mask=ok, other=V)
    top = tl.max(v, 0)
    tl.store(Out + r, tl.min(tl.where(ok & (v == top), i, V), 0))


def lm_head_sample(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab: int,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    config: LMSampleConfig | None = None,
) -> torch.Tensor:
    """hidden: [B, K]; weight: [>= vocab, K] (rows past `vocab` are padding and never drawn); temperatures: [B]
    float32 (0: greedy); seeds, steps: [B] int64 -> the next tokens [B] int32, as sample_tokens would draw them
    from hidden @ weight[:vocab].T."""
    bs, k = hidden.shape
    out = torch.empty(bs, dtype=torch.int32, device=hidden.device)
    if bs == 0:
        return out
    cfg = config or default_config(bs)
    num_tiles = div_ceil(vocab, cfg.cols)
    best_v = torch.empty((bs, num_tiles), dtype=torch.float32, device=hidden.device)
    best_i = torch.empty((bs, num_tiles), dtype=torch.int32, device=hidden.device)
    _lm_head_sample_kernel[(div_ceil(bs, cfg.rows), num_tiles)](
        hidden,
        hidden.stride(0),
        weight,
        weight.stride(0),
        temperatures,
        seeds,
        steps,
        best_v,
        best_i,
        bs,
        vocab,
        k,
        num_tiles,
        BLOCK_M=cfg.rows,
        BLOCK_N=cfg.cols,
        BLOCK_K=cfg.depth,
        EVEN_K=k % cfg.depth == 0,
        PRECISION=dot_precision(hidden.dtype),
        FAST_LOG=hidden.is_cuda and torch.version.hip is None,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    _merge_kernel[(bs,)](best_v, best_i, out, vocab, num_tiles, WIDTH=next_pow2(num_tiles), num_warps=4)
    return out
