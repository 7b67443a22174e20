"""Sampling on the GPU: temperature, noise and argmax in one read of the logits (chunks of each row in
parallel, then a merge of the chunks' winners), and top-k/top-p from a partial sort.

The torch sampler draws token i with probability p_i as argmax p_i / E_i with E_i = -log U_i and U_i
from a hash of (seed, step, i). Taking logs, that is argmax l_i / T - log(-log U_i): no softmax and no
[B, V] temporaries, one read of the logits. The kernel computes the same hash bit for bit, so a seed
gives the same noise on both paths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_chunk_kernel(
    Logits,
    stride_l,
    Temps,
    Seeds,
    Steps,
    BestV,
    BestI,
    V,
    CHUNK,
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # each program takes one chunk of one row: a row alone is too long a serial loop for one program
    r = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temps + r)
    seed = tl.load(Seeds + r).to(tl.uint64, bitcast=True)
    step = tl.load(Steps + r).to(tl.uint64, bitcast=True)
    # splitmix64 of (seed, step, token id), as sample.hash_uniform computes it
    base = seed * 0x9E3779B97F4A7C15 + step * 0x94D049BB133111EB
    greedy = temp <= 0.0
    safe_temp = tl.where(greedy, 1.0, temp)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    end = tl.minimum(c * CHUNK + CHUNK, V)
    for off in range(c * CHUNK, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < end
        logit = tl.load(Logits + r * stride_l + idx, mask=mask, other=float("-inf")).to(tl.float32)
        x = base + idx.to(tl.uint64) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        x = x ^ (x >> 31)
        u = ((x >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noisy = tl.div_rn(logit, safe_temp) - tl.log(-tl.log(u))
        score = tl.where(greedy, logit, tl.where(mask, noisy, float("-inf")))
        better = score > best_v  # strict: each lane keeps its first maximum, as torch.argmax does
        best_v = tl.where(better, score, best_v)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best_v, 0)
    tl.store(BestV + r * NUM_CHUNKS + c, top)
    tl.store(BestI + r * NUM_CHUNKS + c, tl.min(tl.where(best_v == top, best_i, V), 0))


@triton.jit
def _sample_merge_kernel(BestV, BestI, Out, V, NUM_CHUNKS: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, NUM_CHUNKS)
    v = tl.load(BestV + r * NUM_CHUNKS + c)
    i = tl.load(BestI + r * NUM_CHUNKS + c)
    top = tl.max(v, 0)
    # the lowest index among the maxima: the first occurrence, as torch.argmax picks
    tl.store(Out + r, tl.min(tl.where(v == top, i, V), 0))


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """logits: [B, V] (masked entries -inf); temperatures: [B] or [B, 1] (0: greedy); seeds, steps: [B] int64."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    if bs == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temps = temperatures.reshape(-1).to(torch.float32).contiguous()
    block = min(2048, triton.next_power_of_2(vocab))
    num_chunks = min(32, triton.next_power_of_2(triton.cdiv(vocab, 4 * block)))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    best_v = torch.empty((bs, num_chunks), dtype=torch.float32, device=logits.device)
    best_i = torch.empty((bs, num_chunks), dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(bs, num_chunks)](
        logits,
        logits.stride(0),
        temps,
        seeds.contiguous(),
        steps.contiguous(),
        best_v,
        best_i,
        vocab,
        chunk,
        NUM_CHUNKS=num_chunks,
        BLOCK=block,
        num_warps=4,
    )
    _sample_merge_kernel[(bs,)](best_v, best_i, out, vocab, NUM_CHUNKS=num_chunks, num_warps=1)
    return out


def filter_logits_partial(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    window: int = 1024,
) -> torch.Tensor | None:
    """sample.filter_logits from the top `window` tokens of each row instead of a sort of the vocabulary.

    Exact when every row's kept set fits in the window (top-k <= window, and the top-p nucleus inside
    it); returns None otherwise, and the caller sorts the whole vocabulary instead. The checks read
    back from the device, so a batch that uses these filters waits for its forward pass here.
    """
    bs, vocab = logits.shape
    neg_inf = torch.finfo(logits.dtype).min
    if min_p is not None:
        # probs < max_prob * min_p  <=>  logit < max_logit + log(min_p)
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p[:, None])
        logits = logits.masked_fill(logits < floor, neg_inf)
    if top_k is None and top_p is None:
        return logits
    window = min(window, vocab)
    rows_k = top_k if top_k is not None else torch.full((bs,), vocab, device=logits.device)
    limited = rows_k < vocab
    rows_p = top_p if top_p is not None else torch.ones(bs, device=logits.device)
    nucleus = rows_p < 1.0
    if bool((limited & (rows_k > window)).any().item()):
        return None
    values, order = logits.topk(window, dim=-1)  # sorted, descending
    rank = torch.arange(window, device=logits.device)[None, :]
    drop = rank >= rows_k[:, None]
    values = values.masked_fill(drop, neg_inf)
    if top_p is not None:
        # top-p normalises over what top-k kept: the window, or the whole row where top-k is off
        lse = torch.where(
            limited[:, None],
            torch.logsumexp(values, dim=-1, keepdim=True),
            torch.logsumexp(logits, dim=-1, keepdim=True),
        )
        probs = torch.exp(values - lse)
        before = torch.cumsum(probs, dim=-1) - probs
        reach = before[:, -1] + probs[:, -1]
        if bool(((reach < rows_p) & nucleus & ~limited).any().item()):
            return None  # a nucleus reaches past the window
        drop |= before >= rows_p[:, None]
    filtered = torch.full_like(logits, neg_inf).scatter_(1, order, values.masked_fill(drop, neg_inf))
    untouched = ~limited & ~nucleus
    return torch.where(untouched[:, None], logits, filtered)


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    full_filter: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The GPU version of Sampler.sample after penalties; `full_filter` is the sorting filter to fall back on."""
    if top_k is None and top_p is None and min_p is None:
        return sample_tokens(logits, temperatures, seeds, steps)
    temps = temperatures.reshape(-1)
    # the filters see the tempered distribution, as in the torch sampler
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
    filtered = filter_logits_partial(scaled, top_k, top_p, min_p)
    if filtered is None:
        filtered = full_filter(scaled, top_k, top_p, min_p)
    return sample_tokens(filtered, (temps > 0).to(torch.float32), seeds, steps)
