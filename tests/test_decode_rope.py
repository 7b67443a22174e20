"""The rotary kernel's work inside the decode kernel (ENV.FUSED_DECODE_ROPE) against the rotary kernel, its
K/V store, then decode attention: the same outputs, the same bytes in the pool.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, and the engine runs the CUDA path's
layer code there with MINISGL_KERNELS=triton. Skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import CUDA, DEVICE
from tiny import random_prompts

from minisgl.attention.base import DecodeRope, KVDestination
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernel import attention
from minisgl.kernel.rotary import apply_rotary
from minisgl.kvcache.mha_pool import FP8_DTYPE
from minisgl.layers.rotary import RotaryEmbedding

HQ, HK, D = 4, 2, 16
LENS = [1, 7, 70, 33]  # context lengths after this step: the last position of each is its new token

# (model dtype, pool dtype); Triton's interpreter multiplies bf16 tiles wrongly in tl.dot (an FP8 pool's
# tiles with a bf16 query are multiplied in fp16, which it gets right), so bf16 pools run on a GPU only
DTYPES = [
    (torch.float32, torch.float32),
    pytest.param(
        torch.bfloat16,
        torch.bfloat16,
        marks=pytest.mark.skipif(not CUDA, reason="the interpreter's tl.dot is wrong on bf16 tiles"),
    ),
    (torch.bfloat16, FP8_DTYPE),
    (torch.float32, FP8_DTYPE),
]


def _page_table(lens: list[int], page_size: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each request's positions on shuffled pages of the pool; the table and the number of slots."""
    counts = [-(-n // page_size) for n in lens]
    pages = torch.randperm(sum(counts) + 2, generator=g)
    table = torch.zeros(len(lens), max(counts) * page_size, dtype=torch.int32)
    used = 0
    for i, c in enumerate(counts):
        span = pages[used : used + c]
        used += c
        table[i, : c * page_size] = (span[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return table, (sum(counts) + 2) * page_size


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES)
# pages of 16 also take a folded norm's scale: q|k|v come unnormalised with the hidden states beside
@pytest.mark.parametrize("page_size,scaled", [(1, False), (16, True)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tiles", [None, attention.DecodeConfig(16, 4, 2, even=True)], ids=["chosen", "even"])
def test_decode_kernel_rotates_and_stores_as_the_rotary_kernel_does(
    dtype: torch.dtype,
    pool_dtype: torch.dtype,
    page_size: int,
    scaled: bool,
    num_splits: int,
    qk_norm: bool,
    tiles: attention.DecodeConfig | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "DECODE_CONFIG", tiles)
    g = torch.Generator().manual_seed(page_size * 3 + num_splits + 11 * qk_norm)
    bs = len(LENS)
    table, slots = _page_table(LENS, page_size, g)
    loc = torch.tensor([int(table[i, n - 1]) for i, n in enumerate(LENS)])
    # magnitudes up to 1e2, so an FP8 pool at these scales clamps some values at ±448
    qkv = (torch.randn(bs, (HQ + 2 * HK) * D, generator=g) * torch.logspace(-1, 2, bs)[:, None]).to(dtype)
    pool = (torch.randn(slots, HK, D, generator=g) * 4).to(pool_dtype)
    pos = torch.tensor(LENS) - 1 + torch.randint(0, 8, (bs,), generator=g)  # positions need not be lens - 1
    rope = RotaryEmbedding(D, 128, 10000.0, None)
    cos_sin = rope.cos_sin.to(DEVICE)
    weights = None
    if qk_norm:
        weights = (
            torch.randn(D, generator=g).to(dtype).to(DEVICE),
            torch.randn(D, generator=g).to(dtype).to(DEVICE),
        )
    scales = (torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE))
    fp8_scales = scales if pool_dtype == FP8_DTYPE else (None, None)
    rows = torch.arange(bs, dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    page_table = table.to(DEVICE)
    hidden = (torch.randn(bs, 24, generator=g) * torch.logspace(-1, 1, bs)[:, None]).to(dtype).to(DEVICE)
    row_scale = (hidden, 1e-6) if scaled else None

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = qkv.clone().to(DEVICE)
        q = x[:, : HQ * D].view(bs, HQ, D)
        k = x[:, HQ * D : (HQ + HK) * D].view(bs, HK, D)
        v = x[:, (HQ + HK) * D :].view(bs, HK, D)
        k_cache, v_cache = pool.clone().to(DEVICE), pool.flip(0).clone().to(DEVICE)
        args = (k_cache, v_cache, page_table, rows, seq, num_splits, D**-0.5, *fp8_scales)
        if fused:
            w = weights or (None, None)
            rope = DecodeRope(k, v, pos.to(DEVICE), cos_sin, loc.to(DEVICE), *w, 1e-6, row_scale)
            out = attention.decode_attention(q, *args, rope=rope)
        else:
            dest = KVDestination(k_cache, v_cache, loc.to(DEVICE), *scales)
            norms = (*weights, 1e-6) if weights else None
            apply_rotary(pos.to(DEVICE), q, k, cos_sin, norms, v=v, dest=dest, row_scale=row_scale)
            out = attention.decode_attention(q, *args)
        return out.float().cpu(), k_cache.view(torch.uint8).cpu(), v_cache.view(torch.uint8).cpu()

    out, k_bytes, v_bytes = run(True)
    ref_out, ref_k, ref_v = run(False)
    if scaled and CUDA:
        # the row's sum of squares is reduced in each kernel's own thread layout: the scale may differ in
        # its last bit, and a stored element round to its neighbour
        got, want = v_bytes.view(pool_dtype).float(), ref_v.view(pool_dtype).float()
        torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3)
        assert (got != want).float().mean() < 0.02
    else:
        assert torch.equal(v_bytes, ref_v)
    if qk_norm or CUDA:
        # the norm's sum of squares is taken over the head at once here and in two halves by the rotary
        # kernel, and on a GPU the compiler contracts the rotation's products into FMAs differently in the
        # two kernels: a last-bit difference may round a stored element to its neighbour
        got = k_bytes.view(pool_dtype).float()
        want = ref_k.view(pool_dtype).float()
        torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3)
        assert (got != want).float().mean() < 0.02
    else:
        assert torch.equal(k_bytes, ref_k)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(k_bytes[untouched], pool.view(torch.uint8)[untouched])
    tol = 1e-5 if dtype == torch.float32 and pool_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol * max(1.0, ref_out.abs().max().item()))


def test_decode_kernel_refuses_a_head_dim_of_other_widths() -> None:
    q, k = torch.randn(1, HQ, 24, device=DEVICE), torch.randn(1, HK, 24, device=DEVICE)
    cache = torch.zeros(8, HK, 24, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    rope = DecodeRope(k, k.clone(), one, RotaryEmbedding(24, 8, 10000.0, None).cos_sin.to(DEVICE), one)
    table = torch.arange(8, dtype=torch.int32, device=DEVICE)[None, :]
    with pytest.raises(ValueError, match="power-of-2 head dim"):
        attention.decode_attention(q, cache, cache.clone(), table, one * 0, one * 2, 1, 0.1, rope=rope)


# Qwen3: the q/k norm inside the kernel too (the kernel cases above cover the rotation without it)
@pytest.mark.parametrize("variant", ["qwen3"])
def test_engine_with_the_rotary_inside_decode_gives_the_greedy_tokens_of_transformers(
    variant: str, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.FUSED_DECODE_ROPE, "value", 1 << 20)
    calls = {"prefill": 0, "decode": 0}
    real = apply_rotary

    def counted(positions: torch.Tensor, q: torch.Tensor, *args: object, **kwargs: object):
        from minisgl.core import get_global_ctx

        calls[get_global_ctx().batch.phase] += 1
        return real(positions, q, *args, **kwargs)

    monkeypatch.setattr("minisgl.kernel.rotary.apply_rotary", counted)
    folder = tiny_model(variant)
    prompts = random_prompts(3, seed=4, max_len=24)
    # eager steps on a GPU too: a replayed CUDA graph calls no Python, so it would count nothing either way
    llm = make_llm(
        folder,
        page_size=16,
        max_running_req=4,
        device=DEVICE.type,
        cuda_graph_max_bs=0,
        cuda_graph_max_prefill=0,
    )
    calls.update(prefill=0, decode=0)  # the start-up warm-up's steps are not this generate's
    out = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 5)
    # the rotary kernel runs in prefill only: decode rotated (and stored) inside the attention kernel
    assert calls["prefill"] > 0 and calls["decode"] == 0
