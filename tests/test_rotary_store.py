"""The rotary kernel that also stores K and V into the paged pool, against the rotary then the store kernel.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, and the engine runs the CUDA path's
layer code there with MINISGL_KERNELS=triton. Skipped where triton is not installed.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import DEVICE
from tiny import random_prompts

from minisgl.attention.base import KVDestination
from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernel import use_triton
from minisgl.kernel.rotary import apply_rotary
from minisgl.kernel.store import store_kv
from minisgl.kvcache.mha_pool import FP8_DTYPE
from minisgl.layers.moe import MoeExperts
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.moe.triton_backend import TritonMoeBackend

HQ, HK, D = 4, 2, 16


def _slots(lens: list[int], page_size: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """The slots of each request's new tokens (after a random part of its first page, as after a cached
    prefix) on shuffled pages, and the number of pages."""
    offsets = [int(torch.randint(page_size, (1,), generator=g)) for _ in lens]
    counts = [-(-(o + n) // page_size) for o, n in zip(offsets, lens)]
    num_pages = sum(counts) + 2
    pages = torch.randperm(num_pages, generator=g)
    out, used = [], 0
    for o, n, c in zip(offsets, lens, counts):
        span = pages[used : used + c]
        used += c
        out.append((span[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[o : o + n])
    return torch.cat(out), num_pages


# (model dtype, pool dtype): the pool may store the model's dtype or FP8
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, FP8_DTYPE),
    (torch.float32, FP8_DTYPE),
]


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [[13, 5], [1, 1, 1]], ids=["prefill", "decode"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kernel_stores_the_bytes_the_store_kernel_stores(
    dtype: torch.dtype, pool_dtype: torch.dtype, page_size: int, lens: list[int], qk_norm: bool
) -> None:
    g = torch.Generator().manual_seed(len(lens) * 7 + page_size)
    t = sum(lens)
    # magnitudes up to 1e3, so an FP8 pool at these scales clamps some values at ±448
    qkv = (torch.randn(t, (HQ + 2 * HK) * D, generator=g) * torch.logspace(-3, 3, t)[:, None]).to(dtype)
    pos = torch.randint(0, 64, (t,), generator=g)
    rope = RotaryEmbedding(D, 64, 10000.0, None)
    norms = None
    if qk_norm:
        qw, kw = torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
        norms = (qw.to(DEVICE), kw.to(DEVICE), 1e-6)
    loc, num_pages = _slots(lens, page_size, g)
    loc = loc.to(DEVICE)
    scales = (torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE))

    def run(fused: bool, split: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = qkv.clone().to(DEVICE)
        q = x[:, : HQ * D].view(t, HQ, D)
        k = x[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
        v = x[:, (HQ + HK) * D :].view(t, HK, D)
        # NaN bytes where nothing is written: a stray write or a missed one shows
        k_cache = torch.full((num_pages * page_size, HK, D), float("nan"), device=DEVICE).to(pool_dtype)
        v_cache = k_cache.clone()
        fp8_scales = scales if pool_dtype == FP8_DTYPE else (None, None)
        if fused:
            dest = KVDestination(k_cache, v_cache, loc, *scales)
            apply_rotary(pos.to(DEVICE), q, k, rope.cos_sin.to(DEVICE), norms, v=v, dest=dest, split=split)
        else:
            apply_rotary(pos.to(DEVICE), q, k, rope.cos_sin.to(DEVICE), norms, split=split)
            store_kv(k, v, k_cache, v_cache, loc, *fp8_scales)
        return q.cpu(), k.cpu(), k_cache.view(torch.uint8).cpu(), v_cache.view(torch.uint8).cpu()

    # three programs a token (q, k, v) or one doing the three in turn: the same bytes
    ref = run(False, split=False)
    for ours in (run(True), run(True, split=False), run(False)):
        for a, b in zip(ours, ref):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    k_bytes = run(True)[2]
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[loc.cpu()] = False
    # made as the pool was, on its device: a GPU casts NaN to FP8 with other bytes than the CPU does
    nan = torch.full((int(untouched.sum()), HK, D), float("nan"), device=DEVICE).to(pool_dtype)
    nan = nan.view(torch.uint8).cpu()
    assert torch.equal(k_bytes[untouched], nan)


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_folded_norms_row_scale_is_the_scale_applied_before_the_kernel(
    dtype: torch.dtype, pool_dtype: torch.dtype, qk_norm: bool
) -> None:
    # q|k|v of unnormalised hidden states, scaled by each row's 1 / rms in the kernel, against q|k|v scaled
    # (and rounded to their dtype) first, as the norm before the projection would have made them
    g = torch.Generator().manual_seed(5 + qk_norm)
    t = 5
    hidden = (torch.randn(t, 40, generator=g) * torch.logspace(-2, 2, t)[:, None]).to(dtype)
    qkv = (torch.randn(t, (HQ + 2 * HK) * D, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 64, (t,), generator=g).to(DEVICE)
    cos_sin = RotaryEmbedding(D, 64, 10000.0, None).cos_sin.to(DEVICE)
    norms = None
    if qk_norm:
        norms = (
            torch.randn(D, generator=g).to(dtype).to(DEVICE),
            torch.randn(D, generator=g).to(dtype).to(DEVICE),
            1e-6,
        )
    loc = torch.randperm(2 * t, generator=g)[:t].to(DEVICE)
    scales = (torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE))
    inv = torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6)

    def run(
        x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None, split: bool | None = None
    ) -> list[torch.Tensor]:
        x = x.clone().to(DEVICE)
        q = x[:, : HQ * D].view(t, HQ, D)
        k = x[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
        v = x[:, (HQ + HK) * D :].view(t, HK, D)
        k_cache = torch.zeros(2 * t, HK, D, device=DEVICE).to(pool_dtype)
        v_cache = k_cache.clone()
        dest = KVDestination(k_cache, v_cache, loc, *scales)
        apply_rotary(pos, q, k, cos_sin, norms, v=v, dest=dest, split=split, row_scale=row_scale)
        # v last: scaled in place too (a step of fresh prompts attends over q|k|v's rows, not the pool's)
        return [
            q.float().cpu(),
            k.float().cpu(),
            k_cache.float().cpu(),
            v_cache.float().cpu(),
            v.float().cpu(),
        ]

    got = run(qkv, (hidden.to(DEVICE), 1e-6))
    # one program a token (a prefill's many tokens: the row's scale reduced once for q, k and v) or three
    # (each reducing it after its own loads): the same values but where the compiled reductions' last bit
    # parts (seen on an H200, float32 heads), which may flip a rounding to the pool's dtype: one FP8 step
    for split in (True, False):
        for a, b in zip(run(qkv, (hidden.to(DEVICE), 1e-6), split), got):
            torch.testing.assert_close(
                a, b, rtol=1e-5 if a.dtype == pool_dtype == torch.float32 else 0.13, atol=0
            )
    want = run((qkv.float() * inv).to(dtype), None)
    # the scale's last bit may differ (its sum is reduced in another order), and the rotation's
    # differences cancel: tolerances against each tensor's largest element
    tol = 1e-5 if dtype == torch.float32 and pool_dtype == torch.float32 else 0.13
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 0.1 * b.abs().max().item())
    # and the scale did something: rows of hidden states far from unit rms
    assert not torch.allclose(got[3], run(qkv, None)[3])
    with pytest.raises(ValueError, match="needs the K/V destination"):
        apply_rotary(pos, *got[:2], cos_sin, row_scale=(hidden.to(DEVICE), 1e-6))


def test_rotary_kernel_refuses_a_destination_without_v() -> None:
    q, k = torch.randn(2, HQ, D, device=DEVICE), torch.randn(2, HK, D, device=DEVICE)
    cache = torch.zeros(4, HK, D, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    dest = KVDestination(cache, cache.clone(), torch.tensor([0, 1], device=DEVICE), one, one)
    cos_sin = RotaryEmbedding(D, 8, 10000.0, None).cos_sin.to(DEVICE)
    with pytest.raises(ValueError, match="needs v"):
        apply_rotary(torch.tensor([0, 1], device=DEVICE), q, k, cos_sin, dest=dest)


def test_rotary_kernel_refuses_an_fp8_destination_without_scales() -> None:
    q, k = torch.randn(1, HQ, D, device=DEVICE), torch.randn(1, HK, D, device=DEVICE)
    cache = torch.zeros(4, HK, D, dtype=FP8_DTYPE, device=DEVICE)
    dest = KVDestination(cache, cache.clone(), torch.tensor([2], device=DEVICE), None, None)  # type: ignore[arg-type]
    cos_sin = RotaryEmbedding(D, 8, 10000.0, None).cos_sin.to(DEVICE)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        apply_rotary(torch.tensor([0], device=DEVICE), q, k, cos_sin, v=k.clone(), dest=dest)


# qwen3 has the q/k norm in the rotary kernel, llama not; one case stores K/V in a launch of its own; the
# MoE model takes the Triton MoE backend too
# the norms folded into the projections where the model allows it (not the MoE model), and once not
@pytest.mark.parametrize(
    "variant,page_size,separate,fold",
    [
        ("qwen3", 1, False, True),
        ("qwen3", 16, False, True),
        ("qwen3", 16, False, False),
        ("llama", 16, False, True),
        ("qwen3", 16, True, True),
        ("qwen3-moe", 16, False, True),
    ],
)
def test_engine_on_the_triton_path_gives_the_greedy_tokens_of_transformers(
    variant: str, page_size: int, separate: bool, fold: bool, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.SEPARATE_KV_STORE, "value", separate)
    monkeypatch.setattr(ENV.FOLD_NORMS, "value", fold)
    if not separate:

        def separate_store(*args: object) -> None:
            raise AssertionError("the model path should store K/V from the rotary kernel")

        # the attention kernels read K/V from the pool only: right tokens show the rotary kernel wrote them
        monkeypatch.setattr("minisgl.attention.triton_backend.store_kv", separate_store)
    folder = tiny_model(variant)
    prompts = random_prompts(3, seed=4, max_len=24)
    llm = make_llm(folder, page_size=page_size, max_running_req=4, device=DEVICE.type)
    assert isinstance(llm.engine.attn_backend, TritonAttnBackend)
    moe = [m.backend for m in llm.engine.model.modules() if isinstance(m, MoeExperts)]
    assert all(isinstance(b, TritonMoeBackend) for b in moe) and bool(moe) == ("moe" in variant)
    assert llm.engine.model.model.folded == (fold and "moe" not in variant)
    out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)


def test_engine_with_decode_programs_longest_first_gives_the_greedy_tokens_of_transformers(
    tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.DECODE_LONGEST_FIRST, "value", 1)  # every batch
    folder = tiny_model("qwen3")
    # prompts of different lengths: the order differs from the batch's
    prompts = [p[:n] for p, n in zip(random_prompts(3, seed=6, max_len=24), (5, 24, 11))]
    llm = make_llm(folder, page_size=1, max_running_req=4, device=DEVICE.type)
    assert isinstance(llm.engine.attn_backend, TritonAttnBackend) and llm.engine.attn_backend.ordered(1)
    out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)


def test_an_unknown_kernels_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "cuda")
    with pytest.raises(ValueError, match="MINISGL_KERNELS='cuda' is unknown; use auto or triton"):
        use_triton(torch.zeros(1))


def test_engine_on_the_triton_path_reads_its_fp8_stores_as_the_torch_backend_does(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The rotary kernel's FP8 stores (with the checkpoint's per-layer scales) against the torch
    backend's store and dequantizing reads: the same tokens, logits equal to float32 rounding."""
    from test_fp8_kv import _with_kv_scales, greedy_run

    folder = _with_kv_scales(tiny_model("qwen3"), str(tmp_path / "scaled"), [0.5, 2.0], [0.25, 1.5])
    prompts = random_prompts(3, seed=4, max_len=24)
    args = dict(dtype=torch.float32, device=DEVICE.type, max_running_req=4, page_size=16, cuda_graph_max_bs=0)
    torch_run = greedy_run(folder, "fp8", prompts, 6, attention_backend="torch", **args)
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr("minisgl.attention.triton_backend.store_kv", None)  # a separate store would fail
    run = greedy_run(folder, "fp8", prompts, 6, attention_backend="triton", **args)
    assert run.tokens == torch_run.tokens
    for got, want in zip(run.logits, torch_run.logits):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
