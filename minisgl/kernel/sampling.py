"""Sampling on the GPU: temperature, noise and argmax in one read of the logits (chunks of each row in
parallel, then a merge of the chunks' winners), and top-k/top-p/min-p as one threshold per row.

The torch sampler draws token i with probability p_i as argmax p_i / E_i with E_i = -log U_i and U_i
from a hash of (seed, step, i). Taking logs, that is argmax l_i / T - log(-log U_i) (here in base 2, whose
approximate log is one instruction on an NVIDIA GPU): no softmax and no [B, V] temporaries, one read of
the logits. The kernel computes the same hash bit for bit, so a seed gives the same noise on both paths.

The filters keep a set of the form {i : l_i / T >= threshold}, so each row needs one number, found on
the device (`filter_thresholds`): from the row's top tokens, gathered into a window and sorted, or for
a flat row whose kept set does not fit the window, from an exact search over the whole row. Nothing is
read back to the host and no shape depends on the data, so a filtered batch keeps the overlap loop's
pipelining.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch
from minisgl.utils.misc import div_ceil, next_pow2


@triton.jit
def _hash_base(Seeds, Steps, r):
    """The row's part of splitmix64 of (seed, step, token id), as sample.hash_uniform computes it."""
    seed = tl.load(Seeds + r).to(tl.uint64, bitcast=True)
    step = tl.load(Steps + r).to(tl.uint64, bitcast=True)
    return seed * 0x9E3779B97F4A7C15 + step * 0x94D049BB133111EB


@triton.jit
def _hash_uniform(base, idx):
    """Uniform (0, 1) noise of the tokens `idx` of a row: sample.hash_uniform bit for bit."""
    x = base + idx.to(tl.uint64) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return ((x >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2(x) for x > 0: the GPU's approximate instruction (MUFU, a few ulp), or Triton's log2 where there
    is none to call (the interpreter)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], tl.float32, True, 1)
    return tl.log2(x)


@direct_launch
@triton.jit
def _sample_chunk_kernel(
    Logits,
    stride_l,
    Temps,
    Seeds,
    Steps,
    Thresh,
    BestV,
    BestI,
    V,
    CHUNK,
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_THRESH: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    # each program takes one chunk of one row: a row alone is too long a serial loop for one program
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    base = _hash_base(Seeds, Steps, r)
    greedy = temp <= 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    # a greedy row's argmax is kept by every filter, so the threshold only applies to sampled rows
    thresh = float("-inf")
    if HAS_THRESH:
        thresh = tl.load(Thresh + r)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    end = tl.minimum(c * CHUNK + CHUNK, V)
    for off in range(c * CHUNK, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        logit = tl.load(Logits + r * stride_l + idx, mask=mask, other=float("-inf")).to(tl.float32)
        u = _hash_uniform(base, idx)
        scaled = tl.div_rn(logit, safe_temp)
        # l/T - ln(-ln u) times log2(e), less the constant log2(ln 2): the same argmax in base 2, where
        # the GPU's approximate log2 is one instruction (the natural logs took two thirds of the kernel's time)
        noisy = scaled * 1.4426950408889634 - _log2(-_log2(u, FAST_LOG), FAST_LOG)
        score = tl.where(greedy, logit, tl.where(mask & (scaled >= thresh), noisy, float("-inf")))
        better = score > best_v  # strict: each lane keeps its first maximum, as torch.argmax does
        best_v = tl.where(better, score, best_v)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best_v, 0)
    tl.store(BestV + r * NUM_CHUNKS + c, top)
    tl.store(BestI + r * NUM_CHUNKS + c, tl.min(tl.where(best_v == top, best_i, V), 0))


@direct_launch
@triton.jit
def _sample_merge_kernel(BestV, BestI, Out, V, NUM_CHUNKS: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, NUM_CHUNKS)
    v = tl.load(BestV + r * NUM_CHUNKS + c)
    i = tl.load(BestI + r * NUM_CHUNKS + c)
    top = tl.max(v, 0)
    # the lowest index among the maxima: the first occurrence, as torch.argmax picks
    tl.store(Out + r, tl.min(tl.where(v == top, i, V), 0))


def _flat_f32(t: torch.Tensor) -> torch.Tensor:
    """A kernel's [B] float32 argument: t itself when it already is one in memory ([B] or [B, 1], contiguous;
    the kernels index it by row), else a converted copy. The checks are attribute reads, not torch calls,
    which cost the host microseconds each on a decode step's path."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.reshape(-1).to(torch.float32).contiguous()


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    thresholds: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: [B, V] (masked entries -inf); temperatures: [B] or [B, 1] (0: greedy); seeds, steps: [B] int64;
    thresholds: [B] float32, the sampled rows draw only among tokens with logit / T >= their threshold."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    if bs == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temps = _flat_f32(temperatures)
    block = min(2048, next_pow2(vocab))
    num_chunks = min(32, next_pow2(div_ceil(vocab, 4 * block)))
    chunk = div_ceil(div_ceil(vocab, num_chunks), block) * block
    best_v = torch.empty((bs, num_chunks), dtype=torch.float32, device=logits.device)
    best_i = torch.empty((bs, num_chunks), dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(bs, num_chunks)](
        logits,
        logits.stride(0),
        temps,
        seeds.contiguous(),
        steps.contiguous(),
        thresholds if thresholds is not None else temps,
        best_v,
        best_i,
        vocab,
        chunk,
        NUM_CHUNKS=num_chunks,
        BLOCK=block,
        HAS_THRESH=thresholds is not None,
        FAST_LOG=logits.is_cuda and torch.version.hip is None,  # PTX's lg2.approx
        num_warps=4,
    )
    _sample_merge_kernel[(bs,)](best_v, best_i, out, vocab, NUM_CHUNKS=num_chunks, num_warps=1)
    return out


# the most tokens a row's kept set may have for the sorted-window path (a power of two: the sort's size);
# top-k up to this, and the top-p nucleus of any but a flat distribution, take it
WINDOW = 2048
# programs a row for the passes over it: enough that a few rows fill the GPU
CHUNKS = 16


@triton.jit
def _load_scaled(row, off, V, temp, BLOCK: tl.constexpr):
    idx = off + tl.arange(0, BLOCK)
    return tl.div_rn(tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32), temp)


# order-preserving int32 keys of float32 values: a >= b as floats exactly when key(a) >= key(b)
# (except -0.0 < +0.0); key(-inf) = -2139095041 bounds every search from below
@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _unkey(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _search(row, V, temp, lo, hi, target, m, floor, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key K in [lo, hi] whose mass reaches `target`: the number of tokens with x >= unkey(K),
    or with MASS the sum of exp(x - m) over the tokens with x >= unkey(K) and x >= floor (x = logit / T).

    Sixteen pivots a pass, so eight passes over the row narrow any range of 2**32 keys to one: the
    answer is exact, in a fixed number of steps whatever the data.
    """
    j = tl.arange(0, 16)
    for _ in tl.static_range(8):
        step = (hi - lo + 16) // 16
        pivots = _unkey(lo + j.to(tl.int64) * step)
        acc = tl.zeros([16], tl.float32)
        for off in range(0, V, BLOCK):
            x = _load_scaled(row, off, V, temp, BLOCK)
            if MASS:
                w = tl.where(x >= floor, tl.exp(x - m), 0.0)
            else:
                # banned tokens (-inf) do not count: a top-k past the others keeps them all
                w = tl.where(x > float("-inf"), 1.0, 0.0)
            acc += tl.sum(tl.where(x[:, None] >= pivots[None, :], w[:, None], 0.0), 0)
        # pivot 0 is lo, which reaches the target (or is the lower bound the answer cannot be below)
        best = tl.max(tl.where(acc >= target, j, 0), 0).to(tl.int64)
        lo = lo + best * step
        hi = tl.minimum(lo + step - 1, hi)
    return lo


@triton.jit
def _exact_threshold(row, V, temp, m, floor, k, p, BLOCK: tl.constexpr):
    """The threshold from searches over the whole row: 8 passes for top-k, 9 for top-p (the fallback)."""
    thresh = floor
    hi = _key(m)
    if k < V:
        # top-k ranks every token (those min-p drops too): the k-th largest x
        lo = tl.maximum(_key(thresh), -2139095041)
        thresh = tl.maximum(thresh, _unkey(_search(row, V, temp, lo, hi, k, m, thresh, False, BLOCK)))
    if p < 1.0:
        # top-p: the fewest most likely tokens whose mass, over what min-p and top-k kept, reaches p
        total = tl.zeros([BLOCK], tl.float32)
        for off in range(0, V, BLOCK):
            x = _load_scaled(row, off, V, temp, BLOCK)
            total += tl.where(x >= thresh, tl.exp(x - m), 0.0)
        lo = tl.maximum(_key(thresh), -2139095041)
        nucleus = _search(row, V, temp, lo, hi, p * tl.sum(total, 0), m, thresh, True, BLOCK)
        thresh = tl.maximum(thresh, _unkey(nucleus))
    return thresh


@triton.jit
def _row_bounds(Bounds, r, C: tl.constexpr):
    """The row's largest x and its smallest finite x, from the chunks' (_bounds_kernel)."""
    c = tl.arange(0, C)
    m = tl.max(tl.load(Bounds + (r * C + c) * 2), 0)
    least = tl.min(tl.load(Bounds + (r * C + c) * 2 + 1), 0)
    return m, least


@triton.jit
def _cuts(m, least):
    # sixteen cuts from just below the top to the smallest x
    j = tl.arange(0, 16)
    return m - (m - least) * tl.exp2((j - 15).to(tl.float32) * 0.5)


@triton.jit
def _decide(Counts, Masses, Kept, r, cuts, k, p, V, C: tl.constexpr, WINDOW: tl.constexpr):
    """From the chunks' counts and masses above each cut: the highest cut above which lie the k largest
    (or, top-k off, the top-p nucleus), whether the tokens above it fit the window, the cut, the mass
    min-p keeps, and how many tokens lie above the cut."""
    c = tl.arange(0, C)[:, None]
    j = tl.arange(0, 16)
    count = tl.sum(tl.load(Counts + (r * C + c) * 16 + j[None, :]), 0)
    mass = tl.sum(tl.load(Masses + (r * C + c) * 16 + j[None, :]), 0)
    kept_mass = tl.sum(tl.load(Kept + r * C + tl.arange(0, C)), 0)
    covers = tl.where(k < V, count >= k, mass >= p * kept_mass)
    first = tl.min(tl.where(covers, j, 16), 0)
    total = tl.sum(tl.where(j == first, count, 0.0), 0)
    cut = tl.sum(tl.where(j == first, cuts, 0.0), 0)
    return first, (first < 16) & (total <= WINDOW), cut, kept_mass, total


@direct_launch
@triton.jit
def _bounds_kernel(Logits, stride_l, Temps, Bounds, V, chunk, C: tl.constexpr, BLOCK: tl.constexpr):
    # program (row, chunk): the chunk's largest x and smallest finite x (x = logit / T)
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    m = tl.full([], float("-inf"), tl.float32)
    least = tl.full([], float("inf"), tl.float32)
    if temp > 0.0:
        row = Logits + r * stride_l
        for off in range(c * chunk, c * chunk + chunk, BLOCK):
            x = _load_scaled(row, off, V, temp, BLOCK)
            m = tl.maximum(m, tl.max(x, 0))
            least = tl.minimum(least, tl.min(tl.where(x > float("-inf"), x, float("inf")), 0))
    tl.store(Bounds + (r * C + c) * 2, m)
    tl.store(Bounds + (r * C + c) * 2 + 1, least)


@direct_launch
@triton.jit
def _hist_kernel(
    Logits, stride_l, Temps, TopK, TopP, MinP, Bounds, Counts, Masses, Kept, V, chunk,
    C: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program (row, chunk): the chunk's count of tokens above each cut and their mass exp(x - m) over
    # what min-p keeps, and the mass min-p keeps
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    k = tl.load(TopK + r)
    p = tl.load(TopP + r)
    counts = tl.zeros([BLOCK, 16], tl.float32)
    masses = tl.zeros([BLOCK, 16], tl.float32)
    kept = tl.zeros([BLOCK], tl.float32)
    if (temp > 0.0) & ((k < V) | (p < 1.0)):
        m, least = _row_bounds(Bounds, r, C)
        # min-p: p_i < min_p * p_max  <=>  x_i < m + log(min_p); log(0) = -inf keeps every token
        thresh = m + tl.log(tl.load(MinP + r))
        cuts = _cuts(m, least)
        row = Logits + r * stride_l
        for off in range(c * chunk, c * chunk + chunk, BLOCK):
            x = _load_scaled(row, off, V, temp, BLOCK)
            e = tl.where(x >= thresh, tl.exp(x - m), 0.0)
            above = x[:, None] >= cuts[None, :]
            counts += tl.where(above, 1.0, 0.0)
            masses += tl.where(above, e[:, None], 0.0)
            kept += e
    j = tl.arange(0, 16)
    tl.store(Counts + (r * C + c) * 16 + j, tl.sum(counts, 0))
    tl.store(Masses + (r * C + c) * 16 + j, tl.sum(masses, 0))
    tl.store(Kept + r * C + c, tl.sum(kept, 0))


@direct_launch
@triton.jit
def _gather_kernel(
    Logits, stride_l, Temps, TopK, TopP, Bounds, Counts, Masses, Kept, Windows, V, chunk,
    C: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    # program (row, chunk): where the row's kept set fits the window, the chunk's tokens above the cut,
    # written after those of the chunks before it (their counts above that cut say where)
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    k = tl.load(TopK + r)
    p = tl.load(TopP + r)
    if (temp > 0.0) & ((k < V) | (p < 1.0)):
        m, least = _row_bounds(Bounds, r, C)
        first, fits, cut, kept_mass, total = _decide(
            Counts, Masses, Kept, r, _cuts(m, least), k, p, V, C, WINDOW
        )
        if fits:
            before = tl.arange(0, C)
            counts = tl.load(Counts + (r * C + before) * 16 + first, mask=before < c, other=0.0)
            count = tl.sum(counts, 0).to(tl.int32)
            row = Logits + r * stride_l
            window = Windows + r * WINDOW
            for off in range(c * chunk, c * chunk + chunk, BLOCK):
                x = _load_scaled(row, off, V, temp, BLOCK)
                take = (x >= cut).to(tl.int32)
                tl.store(window + count + tl.cumsum(take, 0) - take, x, mask=take > 0)
                count += tl.sum(take, 0)


@direct_launch
@triton.jit
def _threshold_kernel(
    Logits, stride_l, Temps, TopK, TopP, MinP, Thresh, Bounds, Counts, Masses, Kept, Windows, V,
    C: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    # one program per row; a row's filters that are off (k = V, p = 1, min_p = 0) cost no pass
    r = tl.program_id(0)
    temp = tl.load(Temps + r)
    k = tl.load(TopK + r)
    p = tl.load(TopP + r)
    thresh = tl.full([], float("-inf"), tl.float32)
    if temp > 0.0:
        m, least = _row_bounds(Bounds, r, C)
        thresh = m + tl.log(tl.load(MinP + r))
        if (k < V) | (p < 1.0):
            first, fits, cut, kept_mass, total = _decide(
                Counts, Masses, Kept, r, _cuts(m, least), k, p, V, C, WINDOW
            )
            if fits:
                # the window holds the tokens with x >= cut (every token the filters keep among them):
                # sorted, and filtered as sample.filter_logits does
                w = tl.arange(0, WINDOW)
                window = Windows + r * WINDOW
                values = tl.sort(tl.load(window + w, mask=w < total, other=float("-inf")), descending=True)
                if k < V:
                    thresh = tl.maximum(thresh, tl.sum(tl.where(w == k.to(tl.int32) - 1, values, 0.0), 0))
                if p < 1.0:
                    e = tl.where(values >= thresh, tl.exp(values - m), 0.0)
                    # top-p normalises over what top-k kept (all in the window), or else over what min-p kept
                    probs = e / tl.where(k < V, tl.sum(e, 0), kept_mass)
                    # keep a token while the mass before it is below top_p: the first token always stays
                    keep = (tl.cumsum(probs, 0) - probs < p) & (values >= thresh)
                    thresh = tl.maximum(thresh, tl.min(tl.where(keep, values, float("inf")), 0))
            else:
                # a flat row: the kept set does not fit the window
                thresh = _exact_threshold(Logits + r * stride_l, V, temp, m, thresh, k, p, BLOCK)
    tl.store(Thresh + r, thresh)


def filter_thresholds(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """[B] float32: each sampled row keeps the tokens with logit / T >= its threshold, which is what
    sample.filter_logits keeps of the tempered logits (ties at the edge of a top-k or top-p set are all
    kept; the sort keeps an arbitrary few of them). top_k is the vocabulary size, top_p 1 and min_p 0
    where a row does not filter (all [B] float32); greedy rows get -inf.

    Three passes over a row when its kept set lies among its `window` (WINDOW) largest tokens, as it
    does for a top-k below the window and for the nucleus of a peaked distribution: its bounds, its
    counts and masses above sixteen cuts, and the gathering of the tokens above the chosen cut, each
    pass split over CHUNKS programs a row (one program a row was compute-bound: 0.65 ms at any batch
    up to the SM count, on an H200). Then one program a row sorts the window; a flat row takes the
    exact search there instead (up to 19 passes). Which one is decided on the device, per row."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.float32, device=logits.device)
    if bs == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    window = window or WINDOW
    block = 512
    chunk = div_ceil(div_ceil(vocab, CHUNKS), block) * block
    dev = logits.device
    bounds = torch.empty((bs, CHUNKS, 2), dtype=torch.float32, device=dev)
    counts = torch.empty((bs, CHUNKS, 16), dtype=torch.float32, device=dev)
    masses = torch.empty((bs, CHUNKS, 16), dtype=torch.float32, device=dev)
    kept = torch.empty((bs, CHUNKS), dtype=torch.float32, device=dev)
    windows = torch.empty((bs, window), dtype=torch.float32, device=dev)
    temps, top_k, top_p, min_p = (_flat_f32(t) for t in (temperatures, top_k, top_p, min_p))
    stride = logits.stride(0)
    grid = (bs, CHUNKS)
    _bounds_kernel[grid](logits, stride, temps, bounds, vocab, chunk, C=CHUNKS, BLOCK=block, num_warps=4)
    hist = (temps, top_k, top_p, min_p, bounds, counts, masses, kept, vocab, chunk)
    _hist_kernel[grid](logits, stride, *hist, C=CHUNKS, BLOCK=block, num_warps=8)
    gather = (temps, top_k, top_p, bounds, counts, masses, kept, windows, vocab, chunk)
    _gather_kernel[grid](logits, stride, *gather, C=CHUNKS, BLOCK=block, WINDOW=window, num_warps=4)
    _threshold_kernel[(bs,)](
        logits, stride, temps, top_k, top_p, min_p, out, bounds, counts, masses, kept, windows, vocab,
        C=CHUNKS, BLOCK=block, WINDOW=window, num_warps=8,
    )  # fmt: skip
    return out


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The GPU version of Sampler.sample after penalties; a filter is None where no row of the batch uses
    it. Two launches without filters, six with (plus a fill for each filter the batch leaves off)."""
    if top_k is None and top_p is None and min_p is None:
        return sample_tokens(logits, temperatures, seeds, steps)
    bs, vocab = logits.shape

    def rows(t: torch.Tensor | None, off: float) -> torch.Tensor:
        # one dtype for every filter: the kernel compiles once
        return logits.new_full((bs,), off, dtype=torch.float32) if t is None else _flat_f32(t)

    thresholds = filter_thresholds(
        logits, temperatures, rows(top_k, vocab), rows(top_p, 1.0), rows(min_p, 0.0)
    )
    return sample_tokens(logits, temperatures, seeds, steps, thresholds)
