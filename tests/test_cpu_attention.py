"""The CPU decode-attention kernel: each query over its context read in place through the page table.

It must give what the torch reference gives (the context gathered, then scaled-dot-product
attention): float32 to rounding, bf16 K/V within bf16's precision, for page sizes 1 and 16, grouped
query heads, a head_dim that is not hidden/heads (nor a multiple of the kernel's vector width), and
requests of very different lengths in one batch. bf16 queries over a bf16 pool (a bf16 model's) are
computed as torch's SDPA computes bf16 attention, the probabilities rounded to bf16 for their product
with V, in the vector path and in the plain-C builds alike; float32 queries, and any query over a float32
or FP8 pool, keep float32 probabilities. Where the kernel cannot be built, the engine falls back to the
torch backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.attention import create_attn_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kvcache.mha_pool import MHAKVCache

LIB = cpu_kernels.library()
needs_kernel = pytest.mark.skipif(
    LIB is None, reason="no C compiler here: the CPU kernels could not be built"
)


def paged_context(lens: list[int], page_size: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """A page table [len(lens), width] whose rows hold scattered whole pages, as the cache manager hands out."""
    pages_per_row = width // page_size
    order = torch.randperm(len(lens) * pages_per_row, generator=gen)
    pages = order.view(len(lens), pages_per_row)
    offsets = torch.arange(page_size)
    return (pages[:, :, None] * page_size + offsets).reshape(len(lens), width).to(torch.int32)


def reference(q, k_cache, v_cache, table, rows, lens) -> torch.Tensor:
    out = []
    for b in range(q.shape[0]):
        slots = table[rows[b], : lens[b]].long()
        k = k_cache[slots].float().transpose(0, 1)  # [Hk, L, D]
        v = v_cache[slots].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k, v, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
# the last: 8 query heads a KV head of 4 vectors, more than the grouped loops keep in registers
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((6, 6), 48), ((9, 3), 80), ((16, 2), 64)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_torch_reference(
    page_size: int, heads: tuple[int, int], head_dim: int, kv_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    num_q, num_kv = heads
    lens = [1, 5, 16, 17, 100, 300, 2]
    width = 320
    table = paged_context(lens, page_size, width, gen)
    slots = len(lens) * width
    k_cache = torch.randn(slots, num_kv, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(slots, num_kv, head_dim, generator=gen).to(kv_dtype)
    # requests sit in other table rows than their batch order
    rows = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    table = table[torch.argsort(rows)]
    q = torch.randn(len(lens), num_q, head_dim, generator=gen)
    len_t = torch.tensor(lens)

    out = cpu_kernels.decode_attention(LIB, q, k_cache, v_cache, table, rows, len_t, head_dim**-0.5)

    expected = reference(q, k_cache, v_cache, table, rows, lens)
    atol = 2e-6 if kv_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=atol, rtol=1e-4)


def reference_f64(q, k_cache, v_cache, table, rows, lens, scale, k_scale, v_scale, round_p) -> torch.Tensor:
    """Attention in float64 over each request's slots. With round_p the probabilities exp(s - max) are
    rounded to bf16 for their product with V, the sum they are divided by taken before the rounding: what
    torch's SDPA computes in bf16 over a context within its block of 512 keys (all contexts here)."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        slots = table[rows[b], : lens[b]].long()
        k = (k_cache[slots].double() * k_scale).repeat_interleave(group, 1).transpose(0, 1)
        v = (v_cache[slots].double() * v_scale).repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[b].double()[:, None] @ k.transpose(1, 2))[:, 0] * scale
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        total = p.sum(-1, keepdim=True)
        if round_p:
            p = p.to(torch.bfloat16).double()
        out.append((p[:, None] @ v)[:, 0] / total)
    return torch.stack(out)


# one token, a 16-token tile and either side of it, a context of many tiles, an odd one
LENS = [1, 15, 16, 17, 200, 2, 33]


def decode_inputs(
    page_size: int, heads: tuple[int, int], head_dim: int, kv_dtype: torch.dtype, q_dtype: torch.dtype
) -> dict:
    """The kernel's arguments: each request's context in scattered whole pages, its table row not its
    batch index, every slot past its context NaN (so a read of one shows), and the queries a view of a
    wider q|k|v row, as the model hands them over."""
    gen = torch.Generator().manual_seed(page_size * 1000 + heads[0] * 10 + head_dim)
    num_q, num_kv = heads
    width = 208
    table = paged_context(LENS, page_size, width, gen)
    rows = torch.randperm(len(LENS), generator=gen)
    table[rows] = table.clone()
    # FP8 codes cover their range: values around 50 stored, read back times a scale of 0.02
    spread = 50.0 if kv_dtype == torch.float8_e4m3fn else 1.0
    k_cache = torch.randn(len(LENS) * width, num_kv, head_dim, generator=gen) * spread
    v_cache = torch.randn(len(LENS) * width, num_kv, head_dim, generator=gen) * spread
    for n, row in zip(LENS, rows.tolist()):
        k_cache[table[row, n:].long()] = float("nan")
        v_cache[table[row, n:].long()] = float("nan")
    qkv = torch.randn(len(LENS), (num_q + 2 * num_kv) * head_dim, generator=gen).to(q_dtype)
    fp8 = kv_dtype == torch.float8_e4m3fn
    return dict(
        q=qkv[:, : num_q * head_dim].view(len(LENS), num_q, head_dim),
        k_cache=k_cache.to(kv_dtype),
        v_cache=v_cache.to(kv_dtype),
        page_table=table,
        rows=rows,
        lens=torch.tensor(LENS),
        scale=head_dim**-0.5,
        k_scale=0.02 if fp8 else 1.0,
        v_scale=0.03 if fp8 else 1.0,
    )


def expected(args: dict, round_p: bool) -> torch.Tensor:
    return reference_f64(
        args["q"], args["k_cache"], args["v_cache"], args["page_table"], args["rows"], LENS,
        args["scale"], args["k_scale"], args["v_scale"], round_p,
    )  # fmt: skip


def assert_rounds_as_sdpa(out: torch.Tensor, rounded: torch.Tensor) -> None:
    """out is the rounded-probability reference up to float32 sums: at times a probability lands on the
    other side of a bf16 rounding boundary (one step of it, a few 1e-5 in an output), but on average the
    two agree to ~2e-8, where unrounded probabilities are 2e-4 away (2e-3 at most)."""
    err = (out.double() - rounded).abs()
    assert err.max().item() < 2e-4
    assert err.mean().item() < 1e-6


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["group1", "group3", "group4"])
# 48: not a whole number of 32-element pair vectors, the float path with the same rounding
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_bf16_queries_over_a_bf16_pool_round_the_probabilities_as_sdpa(
    page_size: int, heads: tuple[int, int], head_dim: int
) -> None:
    args = decode_inputs(page_size, heads, head_dim, torch.bfloat16, torch.bfloat16)

    out = cpu_kernels.decode_attention(LIB, **args)

    assert out.dtype == torch.float32
    assert_rounds_as_sdpa(out, expected(args, round_p=True))


@needs_kernel
@pytest.mark.parametrize(
    "kv_dtype,q_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float8_e4m3fn, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float8_e4m3fn, torch.bfloat16),
    ],
    ids=["f32", "bf16-pool-f32-q", "fp8-f32-q", "f32-pool-bf16-q", "fp8-bf16-q"],
)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_other_queries_and_pools_keep_float32_probabilities(
    kv_dtype: torch.dtype, q_dtype: torch.dtype, head_dim: int
) -> None:
    args = decode_inputs(16, (9, 3), head_dim, kv_dtype, q_dtype)

    out = cpu_kernels.decode_attention(LIB, **args)

    torch.testing.assert_close(out.double(), expected(args, round_p=False), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    "extra_flags",
    [["-mno-avx512bf16"], ["-mno-avx512f", "-Wno-psabi"]],
    ids=["without-avx512bf16", "without-avx512"],
)
def test_the_plain_c_builds_round_bf16_probabilities_as_the_vector_path(
    tmp_path, extra_flags: list[str]
) -> None:
    plain = cpu_kernels.load(tmp_path, extra_flags)
    args = decode_inputs(16, (9, 3), 64, torch.bfloat16, torch.bfloat16)

    out = cpu_kernels.decode_attention(plain, **args)

    assert_rounds_as_sdpa(out, expected(args, round_p=True))


@needs_kernel
def test_decode_attention_ignores_slots_past_each_length() -> None:
    gen = torch.Generator().manual_seed(0)
    table = paged_context([4, 4], 1, 8, gen)
    k_cache = torch.randn(16, 1, 16, generator=gen)
    v_cache = torch.randn(16, 1, 16, generator=gen)
    rows, lens = torch.tensor([0, 1]), torch.tensor([4, 3])
    q = torch.randn(2, 1, 16, generator=gen)
    before = cpu_kernels.decode_attention(LIB, q, k_cache, v_cache, table, rows, lens, 0.25)
    beyond = table[:, 4:].long()
    k_cache[beyond] = float("nan")
    v_cache[beyond] = float("nan")
    after = cpu_kernels.decode_attention(LIB, q, k_cache, v_cache, table, rows, lens, 0.25)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_auto_backend_falls_back_to_torch_without_the_kernels() -> None:
    pool = MHAKVCache(2, 4, 1, 1, 16, torch.float32, torch.device("cpu"))
    table = torch.zeros(2, 4, dtype=torch.int32)
    old = ENV.DISABLE_CPU_KERNELS.value
    ENV.DISABLE_CPU_KERNELS.value = True
    cpu_kernels.library.cache_clear()
    try:
        backend = create_attn_backend("auto", pool, table, torch.device("cpu"))
    finally:
        ENV.DISABLE_CPU_KERNELS.value = old
        cpu_kernels.library.cache_clear()
    assert type(backend) is TorchAttnBackend


def test_a_failed_build_leaves_the_torch_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.CACHE_DIR, "value", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        cpu_kernels.library.cache_clear()
