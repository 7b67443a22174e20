"""The rotary kernel's work inside the tensor-core decode kernel (decode_tc.cu's `_rope` kernels,
MINISGL_TC_DECODE_ROPE) against the rotary kernel, its K/V store, then the same kernel without it: the same
outputs, the same bytes in the pool. NVRTC compiles them for Hopper on any machine with libnvrtc; the rest needs
a GPU.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_cuda_decode import needs_nvrtc
from test_decode_rope import _page_table
from tiny import random_prompts

from minisgl.attention.base import DecodeRope, KVDestination
from minisgl.env import ENV
from minisgl.kernel import cuda as cuda_kernels
from minisgl.kernel.cuda.decode import (
    TC_BF16_VARIANTS,
    TC_VARIANTS,
    CudaDecode,
    TensorCoreDecode,
    tc_kernel_name,
    tc_program,
)
from minisgl.kvcache.mha_pool import FP8_DTYPE
from minisgl.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
D, HK = 128, 2
# contexts after this step (the last position of each is its new token): one key alone, shorter than a tile,
# than a warp's share, a split's edge, long ones
LENS = [1, 5, 16, 64, 65, 300, 129, 1000]


@needs_nvrtc
@pytest.mark.parametrize("fp8", [True, False])
def test_the_rope_kernels_compile_for_hopper_without_spills_beside_the_plain_ones(fp8: bool) -> None:
    variants = TC_VARIANTS if fp8 else TC_BF16_VARIANTS
    src = tc_program(variants, TensorCoreDecode.GROUPS, fp8, rope=True)
    _, log = cuda_kernels.compile_cubin(src, "sm_90", ["--ptxas-options=-v"], "decode_tc.cu")
    got = {block.split("'")[0]: block for block in log.split("Compiling entry function '")[1:]}
    want = {
        tc_kernel_name(g, v, fp8, rope)
        for g in TensorCoreDecode.GROUPS
        for v in variants
        for rope in (False, True)
    }
    assert set(got) == want
    for g in TensorCoreDecode.GROUPS:
        for v in variants:
            for rope in (False, True):
                name = tc_kernel_name(g, v, fp8, rope)
                block = got[name]
                assert "0 bytes spill stores, 0 bytes spill loads" in block, (name, block)
                # the rotation's shared memory (its inputs, the rotated heads, the new K/V rows) only in the `_rope`
                # kernels, and little enough that an SM still holds the variant's programs (Hopper: 228 KB, 1 KB of
                # it a program's)
                static = re.search(r"(\d+) bytes smem", block)
                assert (static is not None) == rope, (name, block)
                if static is not None:
                    program = int(static.group(1)) + 1024 + TensorCoreDecode.shared_bytes(_Pool(fp8), v)
                    assert program * v[1] <= 228 * 1024, (name, program)
    assert tc_program(variants, (2,), fp8) == tc_program(variants, (2,), fp8, rope=False)
    assert "DECODE_TC_ROPE_KERNEL(decode" not in tc_program(variants, (2,), fp8)


class _Pool:
    """What TensorCoreDecode.shared_bytes reads of a module: the pool's dtype."""

    def __init__(self, fp8: bool) -> None:
        self.fp8 = fp8


def test_the_largest_hidden_row_is_the_kernels_own() -> None:
    """rope_args refuses hidden rows longer than the `_rope` kernels' shared memory holds: the two constants agree."""
    from minisgl.kernel.cuda import source
    from minisgl.kernel.cuda.decode import ROPE_MAX_HIDDEN, rope_args

    found = re.search(r"constexpr int ROPE_MAX_HIDDEN = (\d+);", source("decode_tc.cu"))
    assert found is not None and int(found.group(1)) == ROPE_MAX_HIDDEN
    q = torch.zeros(2, 4, D, dtype=torch.bfloat16)
    kv = torch.zeros(2, HK, D, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    cos_sin = RotaryEmbedding(D, 16, 1e4, None).cos_sin
    for n, fits in ((ROPE_MAX_HIDDEN, True), (ROPE_MAX_HIDDEN + 8, False), (1020, False)):
        hidden = torch.zeros(2, n, dtype=torch.bfloat16)
        rope = DecodeRope(kv, kv.clone(), ids, cos_sin, ids, row_scale=(hidden, 1e-6))
        assert (rope_args(rope, q) is not None) == fits, n


@functools.cache
def _kernels(fp8: bool) -> TensorCoreDecode:
    variants = TC_VARIANTS if fp8 else TC_BF16_VARIANTS
    return TensorCoreDecode(variants=variants, groups=(2, 4, 8), fp8=fp8, rope=True)


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True])
# pages of 16 also take Qwen3's q/k norm, a folded norm's row scale and a bf16 cos | sin table
@pytest.mark.parametrize("page_size,extras", [(1, False), (16, True)])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_kernel_rotates_stores_and_attends_as_the_rotary_kernel_then_the_kernel_do(
    fp8: bool, group: int, num_splits: int, variant: int, page_size: int, extras: bool, ordered: bool
) -> None:
    from minisgl.kernel.attention import decode_order
    from minisgl.kernel.rotary import apply_rotary

    dev = "cuda"
    g = torch.Generator().manual_seed(group * 7 + num_splits + 3 * variant + 11 * extras + 13 * fp8)
    hq, bs = HK * group, len(LENS)
    table, slots = _page_table(LENS, page_size, g)
    loc = torch.tensor([int(table[i, n - 1]) for i, n in enumerate(LENS)])
    pool_dtype = FP8_DTYPE if fp8 else torch.bfloat16
    # q|k|v rows of a projection (the engine's strides), magnitudes from 0.1 to 100: an FP8 pool clamps some
    qkv = (torch.randn(bs, (hq + 2 * HK) * D, generator=g) * torch.logspace(-1, 2, bs)[:, None]).bfloat16()
    pool = (torch.randn(slots, HK, D, generator=g) * 4).to(pool_dtype)
    pos = torch.tensor(LENS) - 1 + torch.randint(0, 8, (bs,), generator=g)  # positions need not be lens - 1
    cos_sin = RotaryEmbedding(D, 2048, 1e6, None).cos_sin.to(dev)
    weights, row_scale = None, None
    if extras:
        cos_sin = cos_sin.bfloat16()
        weights = tuple(torch.randn(D, generator=g).bfloat16().to(dev) for _ in range(2))
        hidden = (torch.randn(bs, 96, generator=g) * torch.logspace(-1, 1, bs)[:, None]).bfloat16().to(dev)
        row_scale = (hidden, 1e-6)
    scales = (torch.tensor([0.5], device=dev), torch.tensor([2.0], device=dev)) if fp8 else (None, None)
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    seq = torch.tensor(LENS, dtype=torch.int32, device=dev)
    order = torch.tensor(decode_order(LENS), dtype=torch.int32, device=dev) if ordered else None
    kernel = _kernels(fp8)

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = qkv.clone().to(dev)
        q = x[:, : hq * D].view(bs, hq, D)
        k = x[:, hq * D : (hq + HK) * D].view(bs, HK, D)
        v = x[:, (hq + HK) * D :].view(bs, HK, D)
        k_cache, v_cache = pool.clone().to(dev), pool.flip(0).clone().to(dev)
        args = (q, k_cache, v_cache, table.to(dev), rows, seq, num_splits, D**-0.5, *scales)
        pick = kernel.variants[variant]
        if fused:
            w = weights or (None, None)
            rope = DecodeRope(k, v, pos.to(dev), cos_sin, loc.to(dev), *w, 1e-6, row_scale)
            params = kernel.rope_params(rope, q, k_cache)
            assert params is not None
            out = kernel(*args, order=order, variant=pick, rope=params)
        else:
            dest = KVDestination(k_cache, v_cache, loc.to(dev), *scales)
            norms = (*weights, 1e-6) if weights else None
            apply_rotary(pos.to(dev), q, k, cos_sin, norms, v=v, dest=dest, row_scale=row_scale)
            out = kernel(*args, order=order, variant=pick)
        return out.float().cpu(), k_cache.view(torch.uint8).cpu(), v_cache.view(torch.uint8).cpu()

    out, k_bytes, v_bytes = run(True)
    ref_out, ref_k, ref_v = run(False)
    for got_bytes, want_bytes in ((k_bytes, ref_k), (v_bytes, ref_v)):
        # the sums of squares (the row's, the heads') are reduced in each kernel's own order and the rotation's
        # products contracted into FMAs by each compiler: a last-bit difference may round a stored element to its
        # neighbour, nothing more
        got, want = got_bytes.view(pool_dtype).float(), want_bytes.view(pool_dtype).float()
        torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3)
        assert (got != want).float().mean() < 0.02
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(k_bytes[untouched], pool.view(torch.uint8)[untouched])
    assert torch.equal(v_bytes[untouched], pool.flip(0).contiguous().view(torch.uint8)[untouched])
    # the new key joins warp 0's softmax last instead of its place in the pool's order, and its K may differ in
    # the last bit: within the bf16 output's rounding
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2 * max(1.0, ref_out.abs().max().item()))


def test_the_rotary_goes_inside_the_tensor_core_kernel_between_the_two_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Up to FUSED_DECODE_ROPE rows Triton's decode kernel rotates, above it up to TC_DECODE_ROPE the tensor-core
    kernel's `_rope` kernels (where they were built), above that the rotary kernel."""
    from types import SimpleNamespace

    from minisgl.attention.triton_backend import TritonAttnBackend

    monkeypatch.setattr(ENV.FUSED_DECODE_ROPE, "value", 16)
    monkeypatch.setattr(ENV.TC_DECODE_ROPE, "value", 128)
    built = SimpleNamespace(tc_decode=SimpleNamespace(rope=True))
    assert [TritonAttnBackend.tc_rope(built, n) for n in (1, 16, 17, 128, 129, 256)] == [  # type: ignore[arg-type]
        False, False, True, True, False, False,
    ]  # fmt: skip
    for without in (SimpleNamespace(tc_decode=None), SimpleNamespace(tc_decode=SimpleNamespace(rope=False))):
        assert not TritonAttnBackend.tc_rope(without, 64)  # type: ignore[arg-type]
    monkeypatch.setattr(ENV.TC_DECODE_ROPE, "value", 0)
    assert not TritonAttnBackend.tc_rope(built, 64)  # type: ignore[arg-type]


def test_a_step_it_cannot_take_is_rotated_by_the_rotary_kernel_first() -> None:
    """Positions of another dtype (or anything else rope_args refuses): the backend rotates and stores as the
    layer would have, then attends without the rotary inside."""
    from minisgl.kernel.cuda.decode import rope_args

    q = torch.zeros(2, 4, D, dtype=torch.bfloat16)
    kv = torch.zeros(2, HK, D, dtype=torch.bfloat16)
    cos_sin = RotaryEmbedding(D, 16, 1e4, None).cos_sin
    good = DecodeRope(
        kv, kv.clone(), torch.zeros(2, dtype=torch.int64), cos_sin, torch.zeros(2, dtype=torch.int64)
    )
    assert rope_args(good, q) is not None
    for bad in (
        DecodeRope(kv, kv, torch.zeros(2, dtype=torch.int32), cos_sin, good.loc),
        DecodeRope(kv.float(), kv.float(), good.positions, cos_sin, good.loc),
        DecodeRope(kv, kv, good.positions, cos_sin.half(), good.loc),
        DecodeRope(kv, kv, good.positions, cos_sin, good.loc, q_weight=torch.ones(D, dtype=torch.bfloat16)),
        DecodeRope(kv, kv, good.positions, cos_sin, good.loc, row_scale=(torch.ones(2, 8), 1e-6)),
    ):
        assert rope_args(bad, q) is None


@pytest.mark.parametrize(
    "variant,kv",
    [("qwen3-head-dim-128", "auto"), ("qwen3-head-dim-128", "fp8_e4m3"), ("llama-head-dim-128-gqa4", "auto")],
)
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_engine_with_the_rotary_inside_stays_with_the_rotary_kernel_and_transformers(
    variant: str,
    kv: str,
    graphs: bool,
    tiny_model: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """24 requests decoding together, every decode step on the tensor-core kernel with the rotary inside (no
    rotary launch in decode): each step's logits close to the run with the rotary kernel, and within test_gpu's
    bf16 bound of transformers' float32 logits (bf16 pool)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "offline"))
    from fp8_agreement import greedy_run
    from test_cuda_decode import assert_runs_agree

    from minisgl.core import get_global_ctx

    folder = tiny_model(variant)
    monkeypatch.setattr(ENV.FUSED_DECODE_ROPE, "value", 0)
    fused_rows: list[int] = []
    rotary_phases: list[str] = []
    call = CudaDecode.__call__

    def counted(self: CudaDecode, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("rope") is not None:
            fused_rows.append(args[0].shape[0])
        return call(self, *args, **kwargs)

    import minisgl.kernel.rotary as rotary_module

    real = rotary_module.apply_rotary

    def rotary_counted(*args: Any, **kwargs: Any) -> Any:
        rotary_phases.append(get_global_ctx().batch.phase)
        return real(*args, **kwargs)

    monkeypatch.setattr(CudaDecode, "__call__", counted)
    monkeypatch.setattr(rotary_module, "apply_rotary", rotary_counted)
    prompts = random_prompts(24, seed=23, min_len=5, max_len=60)
    limits = {} if graphs else dict(cuda_graph_max_bs=0)
    args: dict[str, Any] = dict(dtype=torch.bfloat16, device="cuda", max_running_req=32, **limits)
    monkeypatch.setattr(ENV.TC_DECODE_ROPE, "value", 1 << 20)
    ours = greedy_run(folder, kv, prompts, 12, **args)
    assert fused_rows  # the `_rope` kernels ran (in the graphs' capture, or every eager step)
    if not graphs:
        assert "decode" not in rotary_phases and "prefill" in rotary_phases
    monkeypatch.setattr(ENV.TC_DECODE_ROPE, "value", 0)
    fused_rows.clear()
    plain = greedy_run(folder, kv, prompts, 12, **args)
    assert not fused_rows
    assert_runs_agree(folder, kv, prompts, ours, plain, 0.02)
