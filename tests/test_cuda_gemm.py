"""The CUDA GEMM of few rows (kernel/cuda/gemm.py, MINISGL_CUDA_GEMM_ROWS) and the programmatic edges into it.

On a Hopper GPU: products against float32 sums for the decode shapes of Qwen3-0.6B and Llama-3-8B at 1-16 rows,
with and without the residual (in place), on strided inputs, the same bits each run and in a graph with its edges
programmatic; the engine on a bf16 tiny model with it and the edges as close to transformers as test_gpu asks.
Without one: the split rule, which kernels the pattern calls waiters, and that nothing else takes the path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_cuda_decode import needs_nvrtc

from minisgl.engine import graph_edges
from minisgl.engine.graph_edges import ALWAYS_WAITS, OWN_WAITERS, graph_pattern, name_matcher, waiters_pattern
from minisgl.env import ENV
from minisgl.kernel import cuda as cuda_kernels
from minisgl.kernel.cuda import gemm as cuda_gemm

QWEN_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # q|k|v, o, gate|up, down
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def test_the_weight_bound_keeps_the_products_it_was_faster_at() -> None:
    assert all(n * k <= cuda_gemm.MAX_WEIGHT for n, k in QWEN_SHAPES)
    assert not any(n * k <= cuda_gemm.MAX_WEIGHT for n, k in LLAMA_SHAPES)


def test_split_fills_the_sms_with_whole_k_blocks() -> None:
    # the sweep's fastest (or within 3%) on Qwen3-0.6B's shapes at one row: q|k|v 4, o 8, gate|up 2, down 8
    assert [cuda_gemm.choose_split(n, k, 132) for n, k in QWEN_SHAPES] == [4, 8, 2, 8]
    assert [cuda_gemm.choose_split(n, k, 132) for n, k in LLAMA_SHAPES] == [2, 4, 1, 4]
    for n, k in QWEN_SHAPES + LLAMA_SHAPES + [(192, 64), (64, 640)]:
        split = cuda_gemm.choose_split(n, k, 132)
        assert k % (64 * split) == 0 and split in cuda_gemm.SPLITS


def test_the_gemm_is_a_waiter_whatever_the_kernels_switch() -> None:
    names = [cuda_gemm.Tiles(s).name for s in cuda_gemm.SPLITS]
    for level in (0, 1, 2):
        waits = name_matcher(waiters_pattern("own", level))
        assert all(waits(n) for n in names)
        # the Triton and CUDA decode kernels wait only where the switch compiles the wait in
        assert waits("_rope_kernel") == (level >= 1)
        assert waits("decode_tc_bf16_g2_s2_b3") == (level >= 1)
    assert not name_matcher(OWN_WAITERS)(names[0])
    assert name_matcher(ALWAYS_WAITS)(names[0]) and not name_matcher(ALWAYS_WAITS)("_gemm_kernel")
    assert waiters_pattern("^x$", 0) == "^x$"


def test_graph_pattern_only_up_to_the_row_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.GRAPH_PDL, "value", "own")
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", 2)
    monkeypatch.setattr(ENV.GRAPH_PDL_ROWS, "value", 8)
    assert graph_pattern(1) == graph_pattern(8) == f"{OWN_WAITERS}|{ALWAYS_WAITS}"
    assert graph_pattern(9) == ""
    monkeypatch.setattr(ENV.GRAPH_PDL, "value", "")
    assert graph_pattern(1) == ""


def test_a_cpu_tensor_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 8)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    assert not cuda_gemm.serves(x, w)
    from minisgl.layers.linear import linear

    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))


@needs_nvrtc
def test_every_split_compiles_for_hopper_without_spills() -> None:
    """What the device would load, compiled here: a kernel for each split, none spilling (a spill would put
    the float32 sums in local memory)."""
    _, log = cuda_kernels.compile_cubin(cuda_gemm.program(), "sm_90", ["--ptxas-options=-v"], "gemm.cu")
    blocks = {b.split("'")[0]: b for b in log.split("Compiling entry function '")[1:]}
    for split in cuda_gemm.SPLITS:
        name = cuda_gemm.Tiles(split).name
        assert name in blocks, f"{name} missing from ptxas's report"
        assert "0 bytes spill stores, 0 bytes spill loads" in blocks[name], blocks[name]


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
)


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    return x, w, r


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    # the float32 sums rounded once to bf16: within bf16's half step of each output, plus the sums' order
    err = (y.float() - ref).abs()
    bound = ref.abs() * 2**-8 + 1e-3 * ref.abs().max()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3e}"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", QWEN_SHAPES + LLAMA_SHAPES + [(192, 64)])
def test_products_equal_float32_sums(shape: tuple[int, int], m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 16)
    n, k = shape
    x, w, r = _inputs(m, n, k, seed=m * 7 + n)
    # Llama-3-8B's weights are past the bound the engine keeps (slower there than cuBLAS): the kernel itself
    # still computes them
    assert cuda_gemm.serves(x, w) == (n * k <= cuda_gemm.MAX_WEIGHT)
    ref = x.float() @ w.float().T
    y = cuda_gemm.matmul(x, w)
    _check(y, ref)
    assert torch.equal(y, cuda_gemm.matmul(x, w)), "the same bits every run"
    expected = ref + r.float()
    out = cuda_gemm.matmul(x, w, residual=r)
    assert out.data_ptr() == r.data_ptr(), "the residual is written over"
    _check(out, expected)


@pytest.mark.gpu
@hopper
def test_strided_rows_and_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 8)
    wide = torch.randn(4, 4096, device="cuda").bfloat16()
    w = (torch.randn(1024, 2048, device="cuda") * 0.02).bfloat16()
    x = wide[:, :2048]  # attention's output columns of a wider buffer, as o's input may be
    assert cuda_gemm.serves(x, w)
    _check(cuda_gemm.matmul(x, w), x.float() @ w.float().T)
    assert not cuda_gemm.serves(torch.randn(9, 2048, device="cuda").bfloat16(), w)  # past the bound
    assert not cuda_gemm.serves(x.half(), w.half())
    assert not cuda_gemm.serves(x, w[:1000])  # N not whole tiles
    assert not cuda_gemm.serves(wide[:, 1:2049], w)  # rows not 16-byte aligned
    assert not cuda_gemm.serves(x, w, residual=wide[:, 1:1025])  # nor the residual's
    assert cuda_gemm.serves(x, w, residual=wide[:, :1024].contiguous())
    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 0)
    assert not cuda_gemm.serves(x, w)


@pytest.mark.gpu
@hopper
def test_a_chain_in_a_graph_with_programmatic_edges_equals_the_eager_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer's products in a row, each reading the one before: with every edge into the GEMM programmatic
    (it reads its weights before it waits, its input after), the same bits as launched eagerly."""
    from minisgl.engine.graph_edges import make_programmatic

    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 8)
    ws = [(torch.randn(n, k, device="cuda") * k**-0.5).bfloat16() for n, k in QWEN_SHAPES]
    h0 = torch.randn(2, 1024, device="cuda").bfloat16()
    h = h0.clone()

    def chain() -> None:
        for _ in range(4):
            qkv = cuda_gemm.matmul(h, ws[0])
            cuda_gemm.matmul(qkv[:, :2048], ws[1], residual=h)
            gu = cuda_gemm.matmul(h, ws[2])
            cuda_gemm.matmul(gu[:, :3072], ws[3], residual=h)

    chain()
    eager = h.clone()
    h.copy_(h0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        chain()
    report = make_programmatic(graph.raw_cuda_graph(), name_matcher(ALWAYS_WAITS))
    graph.instantiate()
    assert report.made_programmatic >= 15
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, eager)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("level", [0, 2])
def test_engine_with_the_gemm_and_its_edges_stays_close_to_transformers(
    level: int, tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 tiny Qwen3 with 128-wide heads (its q|k|v, o and gate|up products whole tiles): decode steps of
    1-8 rows through the CUDA GEMM, the graphs' edges into every waiter programmatic; each step's logits within
    test_gpu's bound of transformers' float32 ones and its first token transformers'."""
    from test_gpu import BF16_LOGITS_REL_ERR, _rel_errors, _teacher_forced_logits, record_row0_logits
    from tiny import random_prompts

    from minisgl.core import SamplingParams

    monkeypatch.setattr(ENV.CUDA_GEMM_ROWS, "value", 8)
    monkeypatch.setattr(ENV.GRAPH_PDL, "value", "own")
    monkeypatch.setattr(ENV.GRAPH_PDL_ROWS, "value", 8)
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", level)
    monkeypatch.setattr(ENV.FUSED_SAMPLING, "value", 0)  # every step's logits, recorded
    calls: list[int] = []
    reports: list[Any] = []
    matmul, make = cuda_gemm.matmul, graph_edges.make_programmatic

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return matmul(x, *args, **kwargs)

    def recorded(*args: Any) -> Any:
        reports.append(make(*args))
        return reports[-1]

    monkeypatch.setattr(cuda_gemm, "matmul", counted)
    monkeypatch.setattr("minisgl.engine.graph.make_programmatic", recorded)
    folder = tiny_model("qwen3-head-dim-128")
    llm = make_llm(folder, device="cuda", max_running_req=16, dtype=torch.bfloat16)
    assert calls and max(calls) <= 8, "the decode graphs of 1-8 rows take the CUDA GEMM"
    assert reports and all(r.made_programmatic > 0 for r in reports)
    steps = record_row0_logits(llm)
    for prompt in random_prompts(2, seed=4, min_len=5, max_len=50):
        steps.clear()
        tokens = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]["token_ids"]
        ref = _teacher_forced_logits(folder, prompt + tokens, len(prompt), torch.float32)
        errors = _rel_errors(torch.stack(steps), ref)
        assert max(errors) < BF16_LOGITS_REL_ERR, f"per-step relative errors {errors}"
        assert tokens[:1] == hf_reference(folder, [prompt], 1)[0]
    # a batch of 6 decoding together (a graph of 8 rows) as well
    out = llm.generate(random_prompts(6, seed=9, max_len=40), SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o["token_ids"]) == 6 for o in out)
