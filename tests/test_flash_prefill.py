"""Prefill attention by torch's flash kernel over K/V copied out of the pool (kernel/flash.py).

The rule and the slot lookup run anywhere; the flash kernel itself needs a CUDA device, where it must give what
the extend kernel and a float64 reference give, on a fresh prompt, after a cached prefix and over an FP8 pool.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import CUDA, DEVICE
from test_triton_kernels import fp8_pool, paged_pool, reference_attention, rel_err

from minisgl.kernel.attention import extend_attention
from minisgl.kernel.flash import FlashExtend, context_slots, flash_extend, probe, worth_it

SUPPORT = probe(torch.device("cuda"), torch.bfloat16, 128, 2) if CUDA else None
needs_flash = pytest.mark.skipif(SUPPORT is None, reason="needs torch's cuDNN attention")


def test_worth_it_weighs_queries_a_context_token() -> None:
    # a fresh prompt of m tokens has (m + 1) / 2 queries a context token
    assert worth_it([127], [127], 64, 10**6)
    assert not worth_it([125], [125], 64, 10**6)
    # 8 new tokens after a 4,000-token prefix: about 8 a context token, the paged kernel's case
    assert not worth_it([8], [4008], 64, 10**6)
    # one long prompt beside many short ones: weighted by their contexts
    assert worth_it([2048, 4, 4], [2048, 4, 4], 64, 10**6)
    assert not worth_it([2048], [2048], 0, 10**6)  # 0 turns the path off
    assert not worth_it([2048], [2048], 64, 2047)  # contexts past the copy's room stay paged
    # where cuDNN's mask is not aligned to a context's end, a request after a cached prefix keeps the step paged
    assert worth_it([2048, 300], [2048, 300], 64, 10**6, prefix=False)
    assert not worth_it([2048, 300], [2048, 1300], 64, 10**6, prefix=False)


def test_context_slots_are_each_requests_table_row_in_order() -> None:
    lens = [5, 1, 7]
    table = torch.randint(0, 1000, (4, 9), dtype=torch.int32)
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    got = context_slots(table, rows, seq, cu_k, sum(lens))
    want = torch.cat([table[2, :5], table[0, :1], table[3, :7]])
    assert torch.equal(got, want)


def _flash_meta(table: torch.Tensor, lens: list[int], q_lens: list[int]) -> FlashExtend:
    i32 = dict(dtype=torch.int32, device=DEVICE)
    cu_q = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(lens))], **i32)
    cu_k = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], **i32)
    rows = torch.arange(len(lens), **i32)
    slots = context_slots(table, rows, torch.tensor(lens, **i32), cu_k, sum(lens))
    assert SUPPORT is not None
    heads = (
        None if SUPPORT.gqa else torch.arange(16, device=DEVICE) // 2
    )  # the tests' 16 query heads, 8 KV heads
    return FlashExtend(slots, cu_q, cu_k, max(q_lens), max(lens), heads)


@needs_flash
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix", [False, True], ids=["fresh", "prefix"])
def test_flash_extend_matches_the_reference(page_size: int, prefix: bool) -> None:
    # fresh prompts; or beside one, 300 new tokens after a cached prefix of 1,000 (the queries aligned to the
    # context's end) and a one-token extension, where cuDNN gets that alignment right here
    assert SUPPORT is not None
    if prefix and not SUPPORT.prefix:
        pytest.skip(
            "cuDNN's causal mask is not aligned to the context's end here: only fresh prompts take it"
        )
    lens, q_lens = ([700, 1300, 17], [700, 300, 1]) if prefix else ([700, 300, 17], [700, 300, 17])
    hq, hk, d = 16, 8, 128
    k, v, table = paged_pool(lens, hk, d, page_size, torch.bfloat16, seed=5 + page_size)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE).bfloat16()
    out = flash_extend(q, k, v, _flash_meta(table, lens, q_lens), d**-0.5)
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, q_lens)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel_err(out.cpu(), ref) < 1e-2


@needs_flash
@pytest.mark.gpu
def test_flash_extend_reads_an_fp8_pool_as_the_extend_kernel_does() -> None:
    lens, q_lens, hq, hk, d = [400, 250], [400, 250], 16, 8, 128
    k, v, table = paged_pool(lens, hk, d, 1, torch.float32, seed=11)
    k8, v8, ks, vs, k_ref, v_ref = fp8_pool(k, v * 5, 2.0, 0.125)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE).bfloat16()
    out = flash_extend(q, k8, v8, _flash_meta(table, lens, q_lens), d**-0.5, ks, vs)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    paged = extend_attention(
        q,
        k8,
        v8,
        table,
        torch.arange(2, **i32),
        torch.tensor(lens, **i32),
        torch.tensor([0, 400], **i32),
        torch.tensor(q_lens, **i32),
        max(q_lens),
        d**-0.5,
        ks,
        vs,
    )
    ref = reference_attention(q.cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, q_lens)
    assert rel_err(out.cpu(), ref) < 1e-2
    assert rel_err(out.cpu(), paged.cpu()) < 1e-2
