"""The CUDA C++ decode kernel (minisgl/kernel/cuda): NVRTC compiles it for Hopper without spills (any machine
with libnvrtc), the backend falls back to Triton without it, and on a GPU it attends as a float64 reference
does and the engine's logits with it stay where transformers' and the Triton kernel's are.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tiny import random_prompts

from minisgl.env import ENV
from minisgl.kernel import cuda as cuda_kernels
from minisgl.kernel.cuda.decode import (
    TC_BF16_VARIANTS,
    TC_FEW_ROWS,
    TC_GROUPS,
    TC_SMALL_BATCH,
    TC_VARIANTS,
    CudaDecode,
    TensorCoreDecode,
    kernel_name,
    program,
    tc_kernel_name,
    tc_program,
)

# what decode.cu takes: the engine's variants and groups (minisgl/kernel/cuda/decode.py) and those
# benchmark/offline/decode_cuda.py measures (4 query heads a KV head, 16 threads a key)
ALL_VARIANTS = ((2, 8), (4, 8), (1, 16), (2, 16), (4, 16))
ALL_GROUPS = (1, 2, 4)

CUDA = torch.cuda.is_available()
gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
]


def _nvrtc_here() -> bool:
    try:
        cuda_kernels.nvrtc()
        return True
    except cuda_kernels.CudaUnavailable:
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_here(), reason="libnvrtc not found (nvidia-cuda-nvrtc)")


@needs_nvrtc
def test_the_decode_kernels_compile_for_hopper_without_spills() -> None:
    """Every kernel for both pools; a spill would put the rows the kernel keeps in flight in local memory
    (4 query heads a KV head with 8 threads a key: 239-255 registers, one of them spilling; not used)."""
    src = program((True, False), ALL_VARIANTS, ALL_GROUPS)
    _, log = cuda_kernels.compile_cubin(src, "sm_90", ["--ptxas-options=-v"], "decode.cu")
    # ptxas reports each entry function in a block of lines that starts with its name
    blocks = log.split("Compiling entry function '")[1:]
    got = {block.split("'")[0]: block for block in blocks}
    want = {
        kernel_name(g, v, fp8)
        for g in ALL_GROUPS
        for v in ALL_VARIANTS
        for fp8 in (True, False)
        if g < 4 or v[1] == 16  # 4 query heads keep 8 threads a key's 16 dims each in too many registers
    }
    assert want <= set(got), f"missing from ptxas's report: {sorted(want - set(got))}"
    for name in want:
        assert "0 bytes spill stores, 0 bytes spill loads" in got[name], (name, got[name])


@needs_nvrtc
def test_a_cubin_is_compiled_once_then_read_from_the_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENV.CACHE_DIR, "value", str(tmp_path))
    src = program((True,), ((2, 8),))
    first = cuda_kernels.cached_cubin(src, "sm_90", "decode_fp8.cu")
    compiled: list[str] = []
    monkeypatch.setattr(cuda_kernels, "compile_cubin", lambda *a, **k: compiled.append("again"))
    assert cuda_kernels.cached_cubin(src, "sm_90", "decode_fp8.cu") == first
    assert not compiled
    assert len(list((tmp_path / "cuda_kernels").glob("decode_fp8_sm_90_*.cubin"))) == 1


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("n_keys,group", [(45, 2), (5, 1), (64, 8), (33, 4)])
def test_the_tensor_core_kernels_fragment_layouts_give_attention(n_keys: int, group: int, fp8: bool) -> None:
    """minisgl/kernel/cuda/decode_tc.cu's per-lane index arithmetic, emulated with mma.sync's PTX layouts, with
    the FP8 pool's V dims and the bf16 pool's."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "offline"))
    from decode_tc import dim_of, emulate

    assert emulate(n_keys, group, fp8=fp8) < 1e-9
    # each lane's chunks cover its dims once: g's 16 of the 128, the same set whichever pool
    dims = sorted(dim_of(g, i, fp8) + e for g in range(8) for i in range(8) for e in (0, 1))
    assert dims == list(range(128))


@needs_nvrtc
def test_the_tensor_core_kernels_compile_for_hopper_without_spills() -> None:
    src = tc_program(TC_VARIANTS)
    _, log = cuda_kernels.compile_cubin(src, "sm_90", ["--ptxas-options=-v"], "decode_tc.cu")
    got = {block.split("'")[0]: block for block in log.split("Compiling entry function '")[1:]}
    assert set(got) == {tc_kernel_name(g, v) for g in TensorCoreDecode.GROUPS for v in TC_VARIANTS}
    assert all("0 bytes spill stores, 0 bytes spill loads" in block for block in got.values())


def test_without_nvrtc_the_backend_keeps_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from minisgl.attention import triton_backend

    def missing(*args: Any, **kwargs: Any) -> None:
        raise cuda_kernels.CudaUnavailable("libnvrtc was not found")

    monkeypatch.setattr(triton_backend, "CudaDecode", missing)
    pool = SimpleNamespace(head_dim=128, dtype=torch.bfloat16)
    assert triton_backend._cuda_decode(pool, torch.device("cuda", 0)) is None  # type: ignore[arg-type]
    # nor is it asked for where it does not apply, or where it is switched off
    monkeypatch.setattr(triton_backend, "CudaDecode", lambda *a, **k: "kernel")
    assert triton_backend._cuda_decode(pool, torch.device("cuda", 0)) == "kernel"  # type: ignore[arg-type]
    assert triton_backend._cuda_decode(pool, torch.device("cpu")) is None  # type: ignore[arg-type]
    small = SimpleNamespace(head_dim=64, dtype=torch.bfloat16)
    assert triton_backend._cuda_decode(small, torch.device("cuda", 0)) is None  # type: ignore[arg-type]
    monkeypatch.setattr(ENV.DECODE_CUDA, "value", False)
    assert triton_backend._cuda_decode(pool, torch.device("cuda", 0)) is None  # type: ignore[arg-type]


def test_a_pool_asks_for_the_tensor_core_kernel_where_it_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from minisgl.attention import triton_backend

    monkeypatch.setattr(triton_backend, "TensorCoreDecode", lambda *a, **k: "tensor cores")
    fp8 = SimpleNamespace(head_dim=128, dtype=torch.float8_e4m3fn)
    bf16 = SimpleNamespace(head_dim=128, dtype=torch.bfloat16)
    gpu = torch.device("cuda", 0)
    assert triton_backend._tensor_core_decode(fp8, gpu) == "tensor cores"  # type: ignore[arg-type]
    assert triton_backend._tensor_core_decode(bf16, gpu) == "tensor cores"  # type: ignore[arg-type]
    small = SimpleNamespace(head_dim=64, dtype=torch.float8_e4m3fn)
    assert triton_backend._tensor_core_decode(small, gpu) is None  # type: ignore[arg-type]
    assert triton_backend._tensor_core_decode(fp8, torch.device("cpu")) is None  # type: ignore[arg-type]
    monkeypatch.setattr(ENV.DECODE_TENSOR_CORES, "value", False)
    assert triton_backend._tensor_core_decode(fp8, gpu) is None  # type: ignore[arg-type]
    monkeypatch.setattr(ENV.DECODE_TENSOR_CORES, "value", True)
    monkeypatch.setattr(ENV.DECODE_CUDA, "value", False)
    assert triton_backend._tensor_core_decode(fp8, gpu) is None  # type: ignore[arg-type]

    def missing(*args: Any, **kwargs: Any) -> None:
        raise cuda_kernels.CudaUnavailable("libnvrtc was not found")

    monkeypatch.setattr(ENV.DECODE_CUDA, "value", True)
    monkeypatch.setattr(triton_backend, "TensorCoreDecode", missing)
    assert triton_backend._tensor_core_decode(fp8, gpu) is None  # type: ignore[arg-type]


def test_a_model_whose_group_is_known_compiles_only_the_kernels_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine passes its query heads a KV head: a pool compiles decode.cu's module only for a group the
    tensor-core kernel does not take, and neither for a group neither takes."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from minisgl.attention import triton_backend

    asked: list[tuple[str, tuple[int, ...]]] = []

    def tensor_cores(
        device_index: int, variants: Any, groups: tuple[int, ...], fp8: bool, rope: bool = False
    ) -> str:
        asked.append(("tensor cores", groups))
        return "tensor cores"

    def cuda_cores(fp8: bool, device_index: int, groups: tuple[int, ...]) -> str:
        asked.append(("cuda cores", groups))
        return "cuda cores"

    monkeypatch.setattr(triton_backend, "TensorCoreDecode", tensor_cores)
    monkeypatch.setattr(triton_backend, "CudaDecode", cuda_cores)
    gpu = torch.device("cuda", 0)
    built = {}
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        pool = SimpleNamespace(head_dim=128, dtype=dtype, num_layers=0)
        for group in (None, 1, 2, 4, 8, 16):
            b = triton_backend.TritonAttnBackend(pool, torch.zeros(1, 1), gpu, group)  # type: ignore[arg-type]
            built[(dtype, group)] = (b.tc_decode, b.cuda_decode)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert built[(fp8, None)] == ("tensor cores", "cuda cores")  # not known: both, as before
    assert built[(fp8, 1)] == (None, "cuda cores")
    assert built[(fp8, 2)] == built[(fp8, 4)] == built[(fp8, 8)] == ("tensor cores", None)
    assert built[(fp8, 16)] == (None, None)
    assert built[(bf16, None)] == ("tensor cores", "cuda cores")
    assert built[(bf16, 1)] == (None, "cuda cores")
    assert built[(bf16, 2)] == built[(bf16, 4)] == built[(bf16, 8)] == ("tensor cores", None)
    assert built[(bf16, 16)] == (None, None)
    # a known group compiles that group's kernels only; an unknown one every group the module takes
    assert ("tensor cores", (4,)) in asked and ("cuda cores", (1,)) in asked
    assert ("tensor cores", TC_GROUPS) in asked and ("cuda cores", (1, 2)) in asked
    assert {groups for _, groups in asked} == {(1,), (2,), (4,), (8,), TC_GROUPS, (1, 2)}


def test_the_kernels_compiled_for_one_group_hold_every_entry_point_they_are_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real launchers built for one query group (as the engine builds them), their module faked: every kernel
    they look up or give shared memory to is in the program they compile, and no other group's is."""
    import re

    from minisgl.kernel.cuda import decode

    class Module:
        def __init__(self, src: str) -> None:
            self.defined = set(re.findall(r"^DECODE(?:_TC)?_KERNEL\((\w+),", src, re.M))
            self.used: set[str] = set()

        def function(self, name: str) -> None:
            assert name in self.defined, name
            self.used.add(name)

        def allow_shared(self, name: str, size: int) -> None:
            self.function(name)

    monkeypatch.setattr(decode, "load_module", lambda src, name, device_index=0: Module(src))
    for fp8 in (True, False):
        variants = TC_VARIANTS if fp8 else TC_BF16_VARIANTS
        for group in TC_GROUPS:
            tc = TensorCoreDecode(0, variants, (group,), fp8=fp8)
            assert tc.module.used == tc.module.defined == {tc.kernel(group, v) for v in variants}  # type: ignore[attr-defined]
        cores = CudaDecode(fp8, 0, groups=(1,))
        assert cores.module.used == cores.module.defined  # type: ignore[attr-defined]
        assert all("_g1_" in name for name in cores.module.defined)  # type: ignore[attr-defined]


def test_the_engine_takes_the_tensor_core_kernel_for_the_groups_and_batches_it_is_faster_at() -> None:
    from types import SimpleNamespace

    tc = SimpleNamespace(groups=TC_GROUPS, fp8=True)
    f8 = torch.float8_e4m3fn
    k = torch.zeros(8, 2, 128, dtype=f8)
    for group in (1, 2, 4, 8):
        for rows in (3, TC_SMALL_BATCH, TC_SMALL_BATCH + 1):
            q = torch.zeros(rows, 2 * group, 128, dtype=torch.bfloat16)
            # 2, 4 and 8 query heads a KV head at every batch; 1 keeps decode.cu's kernel
            assert TensorCoreDecode.applies(tc, q, k) == (group >= 2)  # type: ignore[arg-type]
            assert not TensorCoreDecode.applies(tc, q, k.bfloat16())  # type: ignore[arg-type]
    choose, tc = TensorCoreDecode.variant, SimpleNamespace(variants=TC_VARIANTS)
    few, small, large = TC_FEW_ROWS, TC_SMALL_BATCH, TC_SMALL_BATCH + 1
    picks = [choose(tc, n) for n in (1, few, few + 1, small, large, 256)]  # type: ignore[arg-type]
    assert picks == [TC_VARIANTS[-1]] * 2 + [TC_VARIANTS[0]] * 2 + [TC_VARIANTS[-1]] * 2


@functools.cache
def _kernels(fp8: bool) -> CudaDecode:
    return CudaDecode(fp8, variants=ALL_VARIANTS, groups=ALL_GROUPS)


def test_the_kernel_is_asked_for_only_where_it_applies() -> None:
    """`applies` on CPU tensors: the query heads a KV head, the dtypes, head dim 128, rows in 16-byte words."""
    from types import SimpleNamespace

    def applies(q: torch.Tensor, k: torch.Tensor, fp8: bool = False) -> bool:
        return CudaDecode.applies(SimpleNamespace(groups=(1, 2), fp8=fp8), q, k)  # type: ignore[arg-type]

    bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
    k = torch.zeros(8, 2, 128, dtype=bf16)
    qkv = torch.zeros(3, 8 * 128, dtype=bf16)
    q = qkv[:, : 4 * 128].view(3, 4, 128)  # q inside a packed q|k|v row, as the engine has it
    assert applies(q, k) and applies(q[:, :2], k) and applies(q, k.to(f8), fp8=True)
    assert not applies(q, k.to(f8))  # the pool this kernel was built for
    assert not applies(torch.zeros(3, 8, 128, dtype=bf16), k)  # 4 query heads a KV head
    assert not applies(q.float(), k)
    assert not applies(torch.zeros(3, 4, 64, dtype=bf16), torch.zeros(8, 2, 64, dtype=bf16))
    # a row that does not start on a 16-byte boundary, or does not step by whole words
    odd = torch.zeros(3, 4 * 128 + 4, dtype=bf16)
    assert not applies(odd[:, 1 : 4 * 128 + 1].view(3, 4, 128), k)
    assert not applies(odd[:, : 4 * 128].as_strided((3, 4, 128), (4 * 128 + 4, 129, 1)), k)


@dataclass
class ReferenceCase:
    """A decode batch over a paged pool and its float64 reference (`reference_case`)."""

    lens: list[int]
    q: (
        torch.Tensor
    )  # [B, Hq, 128] bf16, the query part of packed q|k|v rows (not contiguous, as the engine has it)
    k: torch.Tensor  # the pool as the kernel reads it: FP8 or bf16
    v: torch.Tensor
    k_scale: torch.Tensor | None  # an FP8 pool's scales, else None
    v_scale: torch.Tensor | None
    table: torch.Tensor
    rows: torch.Tensor
    seq: torch.Tensor
    ref: torch.Tensor  # [B, Hq, 128] float64 attention over the values the pool stands for, on the CPU

    def args(self, num_splits: int, d: int = 128) -> tuple[Any, ...]:
        """The arguments every decode kernel takes, up to the order and variant."""
        scales = (self.k_scale, self.v_scale)
        return (self.q, self.k, self.v, self.table, self.rows, self.seq, num_splits, d**-0.5, *scales)


def reference_case(
    lens: list[int], group: int, seed: int, fp8: bool, hk: int = 2, d: int = 128
) -> ReferenceCase:
    """Requests of `lens` tokens on shuffled pages (K three times V's spread), an FP8 pool (scales 0.5 and 0.25)
    or a bf16 one, `group` query heads a KV head, and the reference over the same stored values."""
    from test_triton_kernels import fp8_pool, paged_pool, reference_attention

    hq = group * hk
    k, v, table = paged_pool(lens, hk, d, 1, torch.float32, seed=seed)
    if fp8:
        kc, vc, ks, vs, k_ref, v_ref = fp8_pool(k * 3, v, 0.5, 0.25)
    else:
        kc, vc, ks, vs = (k * 3).bfloat16(), v.bfloat16(), None, None
        k_ref, v_ref = kc.float(), vc.float()
    qkv = torch.randn(len(lens), (hq + 2 * hk) * d, device=k.device).bfloat16()
    q = qkv[:, : hq * d].view(len(lens), hq, d)
    rows = torch.arange(len(lens), dtype=torch.int32, device=k.device)
    seq = torch.tensor(lens, dtype=torch.int32, device=k.device)
    ref = reference_attention(q.float().cpu(), k_ref.cpu(), v_ref.cpu(), table.cpu(), lens, [1] * len(lens))
    return ReferenceCase(lens, q, kc, vc, ks, vs, table, rows, seq, ref)


def test_a_reference_case_holds_the_pool_the_kernels_read_and_its_reference() -> None:
    """The case the GPU tests and decode_tc.py's check build, on any device: its q strides as the engine's, its
    pool's dtype, and a reference equal to attention over the stored values."""
    pytest.importorskip("triton")
    for fp8 in (True, False):
        c = reference_case([1, 17, 40], 2, 3, fp8)
        assert c.k.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16) and (c.k_scale is None) != fp8
        assert c.q.shape == (3, 4, 128) and not c.q.is_contiguous() and c.ref.shape == c.q.shape
        scale = 0.5 if fp8 else 1.0
        for b, n in enumerate(c.lens):
            slots = c.table[b, :n].long().cpu()
            keys = c.k[slots].float().cpu() * scale  # [n, 2, 128]
            for h in range(4):
                s = keys[:, h // 2] @ c.q[b, h].float().cpu() * 128**-0.5
                vals = c.v[slots].float().cpu()[:, h // 2] * (0.25 if fp8 else 1.0)
                want = torch.softmax(s.double(), 0) @ vals.double()
                assert torch.allclose(c.ref[b, h].double(), want, atol=1e-5)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
@pytest.mark.parametrize("num_splits,ordered", [(1, False), (3, True), (16, False)])
@pytest.mark.parametrize("group", ALL_GROUPS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_kernel_attends_as_a_float64_reference(
    fp8: bool, group: int, num_splits: int, ordered: bool, variant: tuple[int, int]
) -> None:
    from test_triton_kernels import rel_err

    from minisgl.kernel.attention import decode_order

    # contexts shorter than a step of the kernel, than a split, empty splits (16 of 5 keys), and long ones
    c = reference_case([1, 5, 37, 300, 129, 1000, 64], group, group + num_splits, fp8)
    order = torch.tensor(decode_order(c.lens), dtype=torch.int32, device="cuda") if ordered else None
    kernel = _kernels(fp8)
    assert kernel.applies(c.q, c.k)
    out = kernel(*c.args(num_splits), order, variant)
    assert out.dtype == torch.bfloat16 and out.shape == c.q.shape
    assert rel_err(out.float().cpu(), c.ref) < 8e-3  # bf16 output rounding: 2**-9 relative


@pytest.mark.parametrize("variant", [0, 1])
@pytest.mark.parametrize("num_splits,ordered", [(1, False), (3, True), (16, False)])
@pytest.mark.parametrize("group", TensorCoreDecode.GROUPS)
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_tensor_core_kernel_attends_as_a_float64_reference(
    fp8: bool, group: int, num_splits: int, ordered: bool, variant: int
) -> None:
    """Contexts shorter than a tile (16 keys), than a warp's share, empty splits, and long ones; an FP8 pool and a
    bf16 one, each variant the engine takes."""
    from test_triton_kernels import rel_err

    from minisgl.kernel.attention import decode_order

    c = reference_case([1, 5, 37, 300, 129, 1000, 64, 16], group, group + num_splits, fp8)
    order = torch.tensor(decode_order(c.lens), dtype=torch.int32, device="cuda") if ordered else None
    kernel = _tensor_cores(fp8)
    other = c.k.bfloat16() if fp8 else c.k.to(torch.float8_e4m3fn)
    assert kernel.applies(c.q, c.k) and not kernel.applies(c.q, other)
    out = kernel(*c.args(num_splits), order, kernel.variants[variant])
    assert out.dtype == torch.bfloat16 and out.shape == c.q.shape
    # f16 (FP8 pool) or bf16 products and the bf16 output: within 2**-7 relative
    assert rel_err(out.float().cpu(), c.ref) < 8e-3


@functools.cache
def _tensor_cores(fp8: bool) -> TensorCoreDecode:
    variants = TC_VARIANTS if fp8 else TC_BF16_VARIANTS
    return TensorCoreDecode(variants=variants, groups=TensorCoreDecode.GROUPS, fp8=fp8)


def _teacher_forced_logits(folder: str, seq: list[int], prompt_len: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    return logits[prompt_len - 1 : len(seq) - 1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize(
    "variant,kv,tensor_cores",
    [
        ("qwen3-head-dim-128", "auto", False),
        ("llama-head-dim-128-mha", "auto", False),
        ("qwen3-head-dim-128", "fp8_e4m3", False),
        ("llama-head-dim-128-gqa4", "fp8_e4m3", True),
        ("qwen3-head-dim-128", "auto", True),
        ("llama-head-dim-128-gqa4", "auto", True),
    ],
)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_engine_with_the_kernel_stays_with_transformers_and_the_triton_kernel(
    variant: str,
    kv: str,
    tensor_cores: bool,
    tiny_model: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """24 requests decoding together (the rotary kernel apart, so every decode step takes the CUDA kernel,
    in its graph): each step's logits within test_gpu's bf16 bound of transformers' float32 logits (bf16
    pool), and close to the Triton kernel's run at every step both runs reach with the same context."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "offline"))
    from fp8_agreement import greedy_run

    folder = tiny_model(variant)
    monkeypatch.setattr(ENV.FUSED_DECODE_ROPE, "value", 0)
    monkeypatch.setattr(ENV.DECODE_TENSOR_CORES, "value", tensor_cores)
    calls: list[int] = []
    call = CudaDecode.__call__

    def counted(self: CudaDecode, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert isinstance(self, TensorCoreDecode) == tensor_cores  # the kernel meant for this pool and group
        calls.append(args[0].shape[0])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(CudaDecode, "__call__", counted)
    prompts = random_prompts(24, seed=21, min_len=5, max_len=60)
    args: dict[str, Any] = dict(dtype=torch.bfloat16, device="cuda", max_running_req=32)
    ours = greedy_run(folder, kv, prompts, 12, **args)
    assert 24 in calls or 32 in calls  # the graph of the batch (24 rows, or the size it pads to) holds it
    monkeypatch.setattr(ENV.DECODE_CUDA, "value", False)
    calls.clear()
    triton = greedy_run(folder, kv, prompts, 12, **args)
    assert not calls
    assert_runs_agree(folder, kv, prompts, ours, triton, 0.05)


def assert_runs_agree(
    folder: str, kv: str, prompts: list[list[int]], ours: Any, other: Any, bound: float
) -> None:
    """Two greedy runs' logits within `bound` (relative) at every step both reach with the same context, and, on a
    bf16 pool, `ours` within test_gpu's bf16 bound of transformers' float32 logits."""
    from test_gpu import BF16_LOGITS_REL_ERR

    for prompt, tokens, logits, o_tokens, o_logits in zip(
        prompts, ours.tokens, ours.logits, other.tokens, other.logits
    ):
        same = next((i for i, (a, b) in enumerate(zip(tokens, o_tokens)) if a != b), len(tokens)) + 1
        assert _rel(logits[:same], o_logits[:same]).max() < bound
        if kv == "auto":
            errors = _rel(logits, _teacher_forced_logits(folder, prompt + tokens, len(prompt)))
            assert errors.max() < BF16_LOGITS_REL_ERR, errors.tolist()


@needs_nvrtc
def test_with_programmatic_waits_the_kernels_still_compile_for_hopper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MINISGL_PDL_KERNELS puts griddepcontrol.wait first in every decode kernel (a source of its own, so a cubin
    of its own); off, the source is the one measured without it."""
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", 0)
    plain = tc_program(TC_VARIANTS)
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", 1)
    src = tc_program(TC_VARIANTS)
    assert "#define MINISGL_PDL 1" in src and "#define MINISGL_PDL" not in plain
    _, log = cuda_kernels.compile_cubin(src, "sm_90", ["--ptxas-options=-v"], "decode_tc.cu")
    got = {block.split("'")[0] for block in log.split("Compiling entry function '")[1:]}
    assert got == {tc_kernel_name(g, v) for g in TensorCoreDecode.GROUPS for v in TC_VARIANTS}
    # the wait is in the code: the cubins with and without it differ (the CUDA-core kernels' too)
    assert (
        cuda_kernels.compile_cubin(src, "sm_90", [], "decode_tc.cu")[0]
        != (cuda_kernels.compile_cubin(plain, "sm_90", [], "decode_tc.cu")[0])
    )
    waits = program((True,), ALL_VARIANTS[:1])
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", 0)
    assert (
        cuda_kernels.compile_cubin(waits, "sm_90", [], "decode.cu")[0]
        != (cuda_kernels.compile_cubin(program((True,), ALL_VARIANTS[:1]), "sm_90", [], "decode.cu")[0])
    )
