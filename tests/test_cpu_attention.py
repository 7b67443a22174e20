"""The CPU decode-attention kernel: each query over its context read in place through the page table.

It must give what the torch reference gives (the context gathered, then scaled-dot-product
attention): float32 to rounding, bf16 K/V within bf16's precision, for page sizes 1 and 16, grouped
query heads, a head_dim that is not hidden/heads (nor a multiple of the kernel's vector width), and
requests of very different lengths in one batch. Where the kernel cannot be built, the engine falls
back to the torch backend.
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
