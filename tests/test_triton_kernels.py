"""The Triton kernels against their torch versions on tiny shapes.

Without a GPU they run in Triton's interpreter on CPU tensors (slow, so the shapes stay tiny); on a
CUDA machine the same tests run the compiled kernels. Skipped where triton is not installed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreter import CUDA, DEVICE

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.sample import Sampler, filter_logits, hash_uniform
from minisgl.kernel import attention
from minisgl.kernel import sampling as triton_sampling
from minisgl.kernel.activation import silu_and_mul
from minisgl.kernel.attention import decode_attention, extend_attention
from minisgl.kernel.moe import align_block_size, fused_moe
from minisgl.kernel.norm import rms_norm, rms_norm_residual
from minisgl.kernel.rotary import apply_rotary
from minisgl.kernel.sampling import filter_thresholds, sample_tokens
from minisgl.kernel.store import store_kv
from minisgl.kvcache.mha_pool import quantize_fp8
from minisgl.layers import activation as torch_activation
from minisgl.layers import norm as torch_norm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.moe import select_experts
from minisgl.moe.torch_backend import TorchMoeBackend


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def paged_pool(
    lens: list[int], num_kv: int, d: int, page_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K/V pool with every request's tokens on shuffled pages, and the page table that finds them."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages, generator=g)
    width = max(pages_per) * page_size
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages_per):
        pages = order[used : used + n]
        used += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        table[row, : len(slots)] = slots.to(torch.int32)
    k = torch.randn(num_pages * page_size, num_kv, d, generator=g).to(dtype)
    v = torch.randn(num_pages * page_size, num_kv, d, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lens: list[int], q_lens: list[int]
) -> torch.Tensor:
    """float64 causal attention of each request's queries (its last q_len positions) over its context."""
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for row, (n, m) in enumerate(zip(lens, q_lens)):
        slots = table[row, :n].long()
        kk = k[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = v[slots].double().repeat_interleave(group, dim=1)
        qq = q[start : start + m].double()
        scores = torch.einsum("qhd,khd->hqk", qq, kk) / q.shape[-1] ** 0.5
        q_pos = torch.arange(n - m, n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += m
    return torch.cat(out)


# the engine's choice for float32, and unmasked full tiles of 16 keys (a 70-token context: 4 full, 1 masked)
EVEN_TILES = [None, attention.DecodeConfig(16, 4, 2, even=True)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("tiles", EVEN_TILES, ids=["chosen", "even"])
def test_decode_attention_matches_reference(
    page_size: int, num_splits: int, tiles: attention.DecodeConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "DECODE_CONFIG", tiles)
    lens, hq, hk, d = [1, 7, 70, 33], 4, 2, 16
    k, v, table = paged_pool(lens, hk, d, page_size, torch.float32, seed=page_size + num_splits)
    q = torch.randn(len(lens), hq, d).to(DEVICE)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, table, rows, seq, num_splits, d**-0.5)
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, [1] * len(lens))
    assert rel_err(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_longest_first_gives_the_batch_order_bits(num_splits: int) -> None:
    # the order only says which program starts when; each request's output stays in its own row
    lens, hq, hk, d = [5, 70, 1, 33, 70], 4, 2, 16
    k, v, table = paged_pool(lens, hk, d, 1, torch.float32, seed=9 + num_splits)
    q = torch.randn(len(lens), hq, d).to(DEVICE)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    assert attention.decode_order(lens) == [1, 4, 3, 0, 2]
    order = torch.tensor(attention.decode_order(lens), dtype=torch.int32, device=DEVICE)
    plain = decode_attention(q, k, v, table, rows, seq, num_splits, d**-0.5)
    ordered = decode_attention(q, k, v, table, rows, seq, num_splits, d**-0.5, order=order)
    assert torch.equal(plain, ordered)
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, [1] * len(lens))
    assert rel_err(ordered.cpu(), ref) < 1e-5


# the engine's choice for float32, then tiles of 16 with the keys below the diagonal loaded unmasked
# (the cached prefix of 67 keys: 4 full tiles), the query blocks in both orders
EXTEND_TILES = [
    None,
    attention.ExtendConfig(16, 16, 4, 2, even=True),
    attention.ExtendConfig(16, 16, 4, 2, even=True, longest_first=True),
    attention.ExtendConfig(32, 16, 4, 3, longest_first=True),
]
EXTEND_IDS = ["chosen", "even", "even_longest_first", "longest_first"]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tiles", EXTEND_TILES, ids=EXTEND_IDS)
def test_extend_attention_with_cached_prefix_matches_reference(
    page_size: int, tiles: attention.ExtendConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "EXTEND_CONFIG", tiles)
    # a fresh prompt, a request with a cached prefix, and a one-token extension
    lens, q_lens, hq, hk, d = [40, 90, 20], [40, 23, 1], 4, 1, 16
    k, v, table = paged_pool(lens, hk, d, page_size, torch.float32, seed=7 + page_size)
    q = torch.randn(sum(q_lens), hq, d).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 40, 63], **i32)
    out = extend_attention(
        q,
        k,
        v,
        table,
        torch.arange(3, **i32),
        torch.tensor(lens, **i32),
        starts,
        torch.tensor(q_lens, **i32),
        max(q_lens),
        d**-0.5,
    )
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, q_lens)
    assert rel_err(out.cpu(), ref) < 1e-5


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core tiles need a GPU")
def test_bf16_attention_within_bf16_error() -> None:
    lens, hq, hk, d = [300, 1000, 17], 16, 8, 128
    k, v, table = paged_pool(lens, hk, d, 1, torch.bfloat16, seed=3)
    q = torch.randn(len(lens), hq, d, device=DEVICE).bfloat16()
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, [1] * len(lens))
    for splits in (1, 4):
        assert rel_err(decode_attention(q, k, v, table, rows, seq, splits, d**-0.5).cpu(), ref) < 1e-2


def test_short_prompts_take_the_short_tiles() -> None:
    cpu = torch.device("cpu")
    assert attention.extend_config(torch.bfloat16, 128, cpu, attention.SHORT_QUERIES) == attention.SHORT
    assert attention.extend_config(torch.bfloat16, 128, cpu, attention.SHORT_QUERIES + 1) != attention.SHORT
    assert attention.extend_config(torch.float32, 128, cpu, 1) != attention.SHORT  # float32 keeps its own


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core tiles need a GPU")
@pytest.mark.parametrize(
    "tiles", [None, attention.ExtendConfig(128, 128, 8, 3, even=True, longest_first=True)]
)
@pytest.mark.parametrize("short", [False, True], ids=["long", "short"])
def test_bf16_extend_attention_within_bf16_error(
    tiles: attention.ExtendConfig | None, short: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "EXTEND_CONFIG", tiles)
    # a fresh prompt of 700 tokens, and 300 new tokens after a cached prefix of 1,000; `short`: prompts of at
    # most SHORT_QUERIES tokens (the short tiles where the engine picks them), fresh and after a prefix
    lens, q_lens, hq, hk, d = [700, 1300], [700, 300], 16, 8, 128
    if short:
        lens, q_lens = [64, 17, 1040, 1], [64, 17, 40, 1]
    k, v, table = paged_pool(lens, hk, d, 1, torch.bfloat16, seed=5)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE).bfloat16()
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = extend_attention(
        q,
        k,
        v,
        table,
        torch.arange(len(lens), **i32),
        torch.tensor(lens, **i32),
        torch.tensor([sum(q_lens[:i]) for i in range(len(lens))], **i32),
        torch.tensor(q_lens, **i32),
        max(q_lens),
        d**-0.5,
    )
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, q_lens)
    assert rel_err(out.cpu(), ref) < 1e-2


def test_rms_norm_with_and_without_residual_match_torch() -> None:
    x = torch.randn(5, 48).to(DEVICE)
    r = torch.randn(5, 48).to(DEVICE)
    w = torch.randn(48).to(DEVICE)
    y, res = rms_norm_residual(x, r, w, 1e-6)
    assert torch.allclose(res, x + r)
    # the layers' torch version runs on CPU tensors
    assert rel_err(y.cpu(), torch_norm.rms_norm((x + r).cpu(), w.cpu(), 1e-6)) < 1e-6
    # a strided [T, H, D] view, as q/k norm reads the heads out of the qkv projection
    qkv = torch.randn(3, 5 * 16).to(DEVICE)
    q = qkv[:, :48].view(3, 3, 16)
    want = torch_norm.rms_norm(q.cpu(), w[:16].cpu(), 1e-6)
    assert rel_err(rms_norm(q, w[:16], 1e-6).cpu(), want) < 1e-6


def test_silu_and_mul_matches_torch() -> None:
    x = torch.randn(4, 2 * 40).to(DEVICE)
    assert rel_err(silu_and_mul(x).cpu(), torch_activation.silu_and_mul(x.cpu())) < 1e-6


def test_silu_and_mul_with_a_folded_norms_row_scale_matches_scaling_first() -> None:
    # gate|up of unnormalised hidden states: each row scaled by 1 / rms(hidden) before the activation
    x = torch.randn(4, 2 * 40) * 3
    hidden = torch.randn(4, 24) * torch.logspace(-2, 2, 4)[:, None]
    want = torch_activation.silu_and_mul(x * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = silu_and_mul(x.to(DEVICE), (hidden.to(DEVICE), 1e-6)).cpu()
    assert rel_err(got, want) < 1e-6 and rel_err(got, torch_activation.silu_and_mul(x)) > 0.1
    # the torch version (a CPU run) takes the same argument
    assert rel_err(torch_activation.silu_and_mul(x, (hidden, 1e-6)), want) < 1e-6


def test_silu_and_mul_whole_row_programs_give_the_blocked_programs_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a prefill's many rows take a program a row (the row scale reduced once); the same bits as the
    # decode layout's programs of 1,024 columns, here over two of them and a ragged end
    from minisgl.kernel import activation

    x = (torch.randn(3, 2 * 1100) * 3).to(torch.bfloat16).to(DEVICE)
    hidden = (torch.randn(3, 40) * 5).to(torch.bfloat16).to(DEVICE)
    blocked = silu_and_mul(x, (hidden, 1e-6)).cpu()
    monkeypatch.setattr(activation, "ROWS_WHOLE", 2)
    whole = silu_and_mul(x, (hidden, 1e-6)).cpu()
    assert torch.equal(whole.view(torch.int16), blocked.view(torch.int16))
    want = torch_activation.silu_and_mul(x.cpu(), (hidden.cpu(), 1e-6))
    assert rel_err(whole, want) < 3e-2  # the torch version rounds the scaled rows once less


def test_rotary_in_place_matches_torch() -> None:
    rope = RotaryEmbedding(16, 64, 10000.0, None)
    qkv = torch.randn(6, (4 + 2 + 2) * 16)
    q, k = qkv[:, :64].view(6, 4, 16), qkv[:, 64:96].view(6, 2, 16)
    pos = torch.tensor([0, 5, 9, 63, 1, 2])
    ref_q, ref_k = rope(pos, q.clone(), k.clone())  # the torch version, on the CPU
    qkv = qkv.to(DEVICE)
    q, k = qkv[:, :64].view(6, 4, 16), qkv[:, 64:96].view(6, 2, 16)
    apply_rotary(pos.to(DEVICE), q, k, rope.cos_sin.to(DEVICE))
    assert rel_err(q.cpu(), ref_q) < 1e-6 and rel_err(k.cpu(), ref_k) < 1e-6
    assert rel_err(qkv[:, 64:96].view(6, 2, 16).cpu(), ref_k) < 1e-6  # written back into the strided view


def test_store_kv_writes_every_slot() -> None:
    k_cache = torch.full((10, 2, 16), float("nan")).to(DEVICE)
    v_cache = torch.full((10, 2, 16), float("nan")).to(DEVICE)
    kv = torch.randn(3, 2 * 2 * 16).to(DEVICE)
    k, v = kv[:, :32].view(3, 2, 16), kv[:, 32:].view(3, 2, 16)
    loc = torch.tensor([7, 0, 4], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    assert torch.isnan(k_cache[[1, 2, 3, 5, 6, 8, 9]]).all()


def fp8_pool(
    k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An FP8 pool holding k and v at the given scales, its scales as kernels take them, and the float32
    values it stands for (stored * scale): the reference attends over the same FP8 data."""
    k8, v8 = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    ks = torch.tensor([k_scale], device=k.device)
    vs = torch.tensor([v_scale], device=k.device)
    return k8, v8, ks, vs, k8.float() * k_scale, v8.float() * v_scale


@pytest.mark.parametrize("scale", [1.0, 0.01])  # 0.01 clamps the largest values at ±4.48
def test_store_kv_fp8_writes_the_bytes_of_the_torch_quantization(scale: float) -> None:
    # magnitudes from 1e-4 (e4m3 subnormals) to 1e3 (clamped to ±448 at scale 1), and values that round
    # up into the next binade (1.99 -> 2.0)
    g = torch.Generator().manual_seed(5)
    mags = torch.logspace(-4, 3, 12)[:, None, None]
    kv = (torch.randn(12, 2, 2 * 16, generator=g) * mags).to(DEVICE)
    kv[0, 0, :4] = torch.tensor([1.99, -1.99, 0.0155, -1e-6])
    k, v = kv[..., :16], kv[..., 16:]
    k_cache = torch.zeros((20, 2, 16), dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.randperm(20, generator=g)[:12].to(DEVICE)
    k_scale = torch.tensor([scale], device=DEVICE)
    v_scale = torch.tensor([2 * scale], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, loc, k_scale, v_scale)
    want_k, want_v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    assert torch.equal(k_cache[loc].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache[loc].view(torch.uint8), want_v.view(torch.uint8))
    # bf16 inputs, as the model gives them on a GPU
    store_kv(k.bfloat16(), v.bfloat16(), k_cache, v_cache, loc, k_scale, v_scale)
    assert torch.equal(k_cache[loc].view(torch.uint8), quantize_fp8(k.bfloat16(), k_scale).view(torch.uint8))


def test_store_kv_fp8_without_scales_is_refused() -> None:
    cache = torch.zeros((4, 1, 16), dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.randn(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        store_kv(k, k, cache, cache.clone(), torch.tensor([0], device=DEVICE))


@pytest.mark.parametrize("page_size,num_splits", [(1, 1), (4, 3)])
@pytest.mark.parametrize("tiles", EVEN_TILES, ids=["chosen", "even"])
def test_decode_attention_reads_fp8_with_its_scales(
    page_size: int, num_splits: int, tiles: attention.DecodeConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "DECODE_CONFIG", tiles)
    lens, hq, hk, d = [1, 7, 70, 33], 4, 2, 16
    k, v, table = paged_pool(lens, hk, d, page_size, torch.float32, seed=11 + page_size)
    k8, v8, ks, vs, k_ref, v_ref = fp8_pool(k * 3, v, 0.5, 0.25)
    q = torch.randn(len(lens), hq, d).to(DEVICE)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k8, v8, table, rows, seq, num_splits, d**-0.5, ks, vs)
    ref = reference_attention(q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, [1] * len(lens))
    assert out.dtype == q.dtype
    assert rel_err(out.cpu(), ref) < 1e-5
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        decode_attention(q, k8, v8, table, rows, seq, num_splits, d**-0.5)


@pytest.mark.parametrize("tiles", EXTEND_TILES, ids=EXTEND_IDS)
def test_extend_attention_reads_fp8_with_its_scales(
    tiles: attention.ExtendConfig | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "EXTEND_CONFIG", tiles)
    lens, q_lens, hq, hk, d = [40, 90, 20], [40, 23, 1], 4, 1, 16
    k, v, table = paged_pool(lens, hk, d, 4, torch.float32, seed=13)
    k8, v8, ks, vs, k_ref, v_ref = fp8_pool(k, v * 5, 2.0, 0.125)
    q = torch.randn(sum(q_lens), hq, d).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = extend_attention(
        q,
        k8,
        v8,
        table,
        torch.arange(3, **i32),
        torch.tensor(lens, **i32),
        torch.tensor([0, 40, 63], **i32),
        torch.tensor(q_lens, **i32),
        max(q_lens),
        d**-0.5,
        ks,
        vs,
    )
    ref = reference_attention(q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, q_lens)
    assert rel_err(out.cpu(), ref) < 1e-5


def test_fp8_attention_with_half_queries_runs_in_fp16_within_its_error() -> None:
    """A half-precision query meets the FP8 tiles in fp16 (e4m3 values are exact there): the error is
    fp16's rounding of the probabilities, far below the FP8 rounding the pool already holds."""
    lens, q_lens, hq, hk, d = [40, 9], [40, 1], 4, 2, 16
    k, v, table = paged_pool(lens, hk, d, 1, torch.float32, seed=17)
    k8, v8, ks, vs, k_ref, v_ref = fp8_pool(k, v, 0.5, 2.0)
    q = torch.randn(sum(q_lens), hq, d).half().to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    rows, seq = torch.arange(2, **i32), torch.tensor(lens, **i32)
    out = extend_attention(
        q,
        k8,
        v8,
        table,
        rows,
        seq,
        torch.tensor([0, 40], **i32),
        torch.tensor(q_lens, **i32),
        40,
        d**-0.5,
        ks,
        vs,
    )
    ref = reference_attention(q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, q_lens)
    assert out.dtype == torch.float16 and rel_err(out.cpu(), ref) < 2e-3
    decode_q = q[[39, 40]]
    out = decode_attention(decode_q, k8, v8, table, rows, seq, 2, d**-0.5, ks, vs)
    ref = reference_attention(decode_q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, [1, 1])
    assert rel_err(out.cpu(), ref) < 2e-3


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core tiles need a GPU")
def test_fp8_attention_with_bf16_queries_within_bf16_error() -> None:
    lens, hq, hk, d = [300, 1000, 17], 16, 8, 128
    k, v, table = paged_pool(lens, hk, d, 1, torch.float32, seed=4)
    k8, v8, ks, vs, k_ref, v_ref = fp8_pool(k, v, 0.5, 0.5)
    q = torch.randn(len(lens), hq, d, device=DEVICE).bfloat16()
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = reference_attention(q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, [1] * len(lens))
    for splits in (1, 4):
        out = decode_attention(q, k8, v8, table, rows, seq, splits, d**-0.5, ks, vs)
        assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("vocab", [1000, 20000])  # one chunk a row, and several
def test_sampling_kernel_draws_what_the_torch_sampler_draws(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    bs = 6
    logits = (torch.randn(bs, vocab, generator=g) * 3).to(DEVICE)
    temps = torch.tensor([0.0, 0.6, 1.0, 1.5, 0.3, 0.0], device=DEVICE)
    seeds = torch.tensor([1, 2, 3, 2**62, -5, 7], dtype=torch.int64, device=DEVICE)
    steps = torch.tensor([10, 11, 0, 5, 999, 3], dtype=torch.int64, device=DEVICE)
    got = sample_tokens(logits, temps, seeds, steps)
    # the torch sampler's exponential race with the same hash noise
    probs = torch.softmax(logits / torch.where(temps > 0, temps, 1.0)[:, None], dim=-1)
    noise = -torch.log(hash_uniform(seeds, steps, vocab))
    want = torch.where(temps > 0, torch.argmax(probs / noise, dim=-1), torch.argmax(logits, dim=-1))
    assert got.tolist() == want.to(torch.int32).tolist()


def _filter_rows(bs: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows a filter meets: peaked, flat (a 0.9 nucleus of most of the vocabulary), with banned tokens."""
    g = torch.Generator().manual_seed(bs)
    logits = torch.randn(bs, vocab, generator=g) * 4
    logits[1] = torch.randn(vocab, generator=g) * 0.01
    logits[2, : vocab // 3] = float("-inf")
    temps = torch.tensor([1.0, 1.0, 0.7, 1.3, 0.0, 2.0])[:bs]
    return logits, temps


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [
        ([3, 1000, 50, 700, 7, 1], None, None),
        (None, [0.9, 0.9, 0.5, 0.99, 0.3, 1e-8], None),
        (None, None, [0.05, 0.5, 1.0, 1e-3, 0.2, 0.1]),
        ([20, 1000, 5, 1000, 3, 900], [0.8, 0.95, 1.0, 0.95, 0.5, 0.9], [0.0, 0.05, 0.0, 0.1, 0.0, 0.0]),
    ],
)
# a window of 16 sends most rows to the exact search, one of 256 most to the sorted window
@pytest.mark.parametrize("window", [16, 256])
def test_threshold_filter_keeps_what_the_sorting_filter_keeps(top_k, top_p, min_p, window) -> None:
    vocab = 1000
    logits, temps = _filter_rows(6, vocab)

    def t(values, off):
        return torch.tensor(values if values is not None else [off] * 6, dtype=torch.float32)

    args = (t(top_k, vocab), t(top_p, 1.0), t(min_p, 0.0))
    thresholds = filter_thresholds(
        logits.to(DEVICE), temps.to(DEVICE), *(a.to(DEVICE) for a in args), window=window
    )
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
    want = filter_logits(scaled, *args) > torch.finfo(torch.float32).min
    got = scaled >= thresholds.cpu()[:, None]
    # banned tokens (-inf) are never drawn, whatever side of the threshold they fall on
    sampled, finite = temps > 0, scaled > float("-inf")
    assert torch.equal((got & finite)[sampled], (want & finite)[sampled])
    assert (thresholds.cpu()[~sampled] == float("-inf")).all()


def _sampler_batch(params: list[SamplingParams], vocab: int) -> tuple[Sampler, Batch]:
    reqs = [
        Req(
            input_ids=[0] * (3 + i),
            table_idx=i,
            cached_len=2 + i,
            output_len=4,
            uid=i,
            sampling_params=p,
            cache_handle=None,
            seed=1000 + i,
        )
        for i, p in enumerate(params)
    ]
    batch = Batch(reqs=reqs, phase="decode")
    batch.positions = torch.tensor([r.cached_len for r in reqs], device=DEVICE)
    return Sampler(DEVICE, vocab), batch


def test_the_kernels_draw_the_torch_samplers_tokens_for_every_filter_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same seeds give the same tokens on the device path (threshold kernel, then the sampling
    kernel) as on the torch path (sort, softmax, exponential race), greedy rows beside filtered ones."""
    if not CUDA:
        monkeypatch.setattr(triton_sampling, "WINDOW", 128)  # the interpreter sorts 2048 values slowly
    vocab = 1000
    params = [
        SamplingParams(temperature=0.9, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=100, top_p=0.8, min_p=0.01),
        SamplingParams(temperature=0.8),
    ] * 4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(params), vocab, generator=g) * 3
    sampler, batch = _sampler_batch(params, vocab)
    args = sampler.prepare(batch, torch.zeros((len(params), 16), dtype=torch.int32, device=DEVICE))
    got = sampler.sample(logits.to(DEVICE), args).cpu()
    cpu_sampler, cpu_batch = Sampler(torch.device("cpu"), vocab), Batch(reqs=batch.reqs, phase="decode")
    cpu_batch.positions = batch.positions.cpu()
    want = cpu_sampler.sample(
        logits, cpu_sampler.prepare(cpu_batch, torch.zeros((len(params), 16), dtype=torch.int32))
    )
    assert got.tolist() == want.tolist()


def test_rotary_with_qk_norm_matches_norm_then_rotary() -> None:
    from minisgl.layers.norm import RMSNorm

    rope = RotaryEmbedding(16, 64, 10000.0, None)
    q_norm, k_norm = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    q_norm.weight.data.normal_(), k_norm.weight.data.normal_()
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    pos = torch.tensor([0, 3, 7, 63, 11])
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    ref_q, ref_k = rope.forward_with_qk_norm(pos, q.clone(), k.clone(), q_norm, k_norm)  # torch, on the CPU
    qkv = qkv.to(DEVICE)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    weights = (q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), 1e-6)
    apply_rotary(pos.to(DEVICE), q, k, rope.cos_sin.to(DEVICE), weights)
    assert rel_err(q.cpu(), ref_q) < 1e-6 and rel_err(k.cpu(), ref_k) < 1e-6


@pytest.mark.parametrize("num_experts, top_k, block_m", [(8, 2, 4), (6, 3, 16), (64, 8, 16)])
def test_align_block_size_puts_every_pair_once_in_blocks_of_one_expert(num_experts, top_k, block_m) -> None:
    g = torch.Generator().manual_seed(num_experts)
    num_tokens = 13
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids.to(DEVICE), num_experts, block_m)
    sorted_ids, expert_ids, used = sorted_ids.cpu().long(), expert_ids.cpu().long(), int(num_padded)
    num_pairs = num_tokens * top_k
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()) <= len(sorted_ids)
    assert sorted(sorted_ids[sorted_ids < num_pairs].tolist()) == list(range(num_pairs))
    assert (sorted_ids[used:] == num_pairs).all()
    for b in range(used // block_m):
        pairs = sorted_ids[b * block_m : (b + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        assert len(pairs) > 0 and (topk_ids.flatten()[pairs] == expert_ids[b]).all()


# (tokens, experts, top_k): decode-like, a few tokens per expert, and many (taller row blocks)
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (5, 4, 1), (40, 4, 2), (150, 4, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_the_torch_backend(num_tokens, num_experts, top_k, renormalize) -> None:
    hidden, inter = 40, 24  # not multiples of the tiles: the masks are exercised
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, renormalize)
    want = TorchMoeBackend().forward(x, gate_up, down, weights, ids)
    got = fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)))
    assert rel_err(got.cpu(), want) < 1e-5


@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 256), (5, 200, 384), (17, 64, 1000), (40, 130, 512)])
@pytest.mark.parametrize("split", [1, 3])
def test_skinny_gemm_matches_a_float32_product_and_leaves_its_counters_at_zero(
    m: int, n: int, k: int, split: int
) -> None:
    from minisgl.kernel import gemm

    # the interpreter has no bf16 tensor-core tiles (see the bf16 attention test); a GPU runs bf16 too
    dtypes = (torch.float16, torch.bfloat16) if CUDA else (torch.float16,)
    gen = torch.Generator().manual_seed(m * n + k)
    for dtype in dtypes:
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
        cfg = gemm.GemmConfig(16, 64, 128, split, 4, 2)
        y = gemm.skinny_matmul(x, w, cfg)
        ref = x.float() @ w.float().T
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y.float().cpu(), ref.cpu()) < 2e-3
        # the partials are added in split order: the same bits whichever program finished last
        assert torch.equal(gemm.skinny_matmul(x, w, cfg), y)
        assert not gemm._workspace(x.device)[1].any()
        # a residual added to the float32 sums (a folded norm's residual add, in o_proj and down_proj)
        r = torch.randn(m, n, generator=gen).to(DEVICE, dtype) * 10
        y = gemm.skinny_matmul(x, w, cfg, residual=r)
        assert rel_err(y.float().cpu(), (ref + r.float()).cpu()) < 2e-3
        assert not gemm._workspace(x.device)[1].any()


def test_skinny_gemm_serves_the_chosen_tiles_and_an_empty_batch() -> None:
    from minisgl.kernel import gemm

    for m, n, k in [(1, 4096, 1024), (64, 1024, 3072), (256, 6144, 1024)]:
        cfg = gemm.choose_config(m, n, k, 132)
        programs = -(-m // cfg.block_m) * -(-n // cfg.block_n) * cfg.split
        # at least a wave of the GPU, at most the workspace's partials
        assert programs >= 132 or cfg.split == -(-k // cfg.block_k) // 2
        assert cfg.split * m * n <= gemm._WORKSPACE_FLOATS
    # the engine sends it the narrow outputs of few rows only (o_proj, down_proj), cuBLAS the rest
    assert gemm.serves(1, 1024, 2048) and gemm.serves(16, 1024, 3072)
    assert not gemm.serves(1, 4096, 1024) and not gemm.serves(17, 1024, 3072)
    x = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    assert gemm.skinny_matmul(x, torch.randn(32, 64).to(DEVICE, torch.float16)).shape == (0, 32)


def test_the_persistent_mlp_half_matches_float32() -> None:
    """benchmark/offline/mlp_persistent.py's kernel (o, gate|up with SiLU, down): phase by phase on the
    interpreter (one launch each), fused with its grid barriers on a GPU; the tickets and barrier left at zero."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "offline"))
    import mlp_persistent as mp

    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if CUDA else torch.float32  # the interpreter has no bf16 tensor-core tiles
    wo = torch.randn(mp.H, mp.KO, generator=gen) * mp.KO**-0.5
    wgu = torch.randn(2 * mp.INTER, mp.H, generator=gen) * mp.H**-0.5
    wd = torch.randn(mp.H, mp.INTER, generator=gen) * mp.INTER**-0.5
    a, r = torch.randn(5, mp.KO, generator=gen), torch.randn(5, mp.H, generator=gen)
    ws = mp.Workspace(torch.device(DEVICE))
    args = [t.to(DEVICE, dtype) for t in (a, wo, r, wgu, wd)]
    want = mp.reference(*args[:2], args[2].clone(), *args[3:], 1e-6).float()
    act = torch.empty(5, mp.INTER, dtype=dtype, device=DEVICE)
    for fused in (False, True) if CUDA else (False,):
        got = mp.mlp_half(*args[:2], args[2].clone(), *args[3:], act, ws, 1e-6, 7, fused).float()
        assert rel_err(got.cpu(), want.cpu()) < (1e-2 if CUDA else 1e-5)
        assert not ws.counters.any() and not ws.bar.any()


def test_the_decode_variant_with_v_transposed_in_pages_matches_the_engine_kernel() -> None:
    """benchmark/offline/decode_vt.py's kernel (V as [page, kv head, dim, slot in page]) on the engine's
    placement with pages of 16: the same attention as the engine's kernel over the plain pool."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "offline"))
    from decode_vt import check

    assert check(DEVICE.type) < 1e-5  # float32 products, in full precision as the engine's kernel takes them


def test_the_wrappers_integer_helpers_agree_with_tritons() -> None:
    """The kernel wrappers size their grids and blocks with utils.misc's helpers, not Triton's constexpr
    functions (about 1.5 us a call): the same values over every size a wrapper passes."""
    import triton

    from minisgl.utils.misc import div_ceil, next_pow2

    for n in list(range(1, 300)) + [1023, 1024, 1025, 151_936, 1 << 20]:
        assert next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 128, 1000):
            assert div_ceil(n, d) == triton.cdiv(n, d)
