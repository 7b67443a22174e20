"""Programmatic edges in captured CUDA graphs (engine/graph_edges.py, MINISGL_GRAPH_PDL and MINISGL_PDL_KERNELS).

An edge may be made programmatic only into a kernel that waits for its inputs on the device: the names this project
calls its own waiters must be exactly its kernels that wait. On a GPU: a consumer without the wait reads its input
before the producer writes it (the check can fail), one with it does not, and the engine with every edge into its
own waiters made programmatic gives transformers' greedy tokens.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil

import pytest
import torch

import minisgl.kernel
from minisgl.engine.graph_edges import OWN_WAITERS, EdgeData, KernelNodeParams, name_matcher
from minisgl.env import ENV
from minisgl.kernel.cuda.decode import (
    TC_BF16_VARIANTS,
    TC_VARIANTS,
    VARIANTS,
    TensorCoreDecode,
    kernel_name,
    tc_kernel_name,
)
from minisgl.kernel.launch import Launcher


def test_the_driver_structures_have_cuda_h_layouts() -> None:
    assert ctypes.sizeof(EdgeData) == 8 and EdgeData.type.offset == 2
    # CUDA_KERNEL_NODE_PARAMS_v2: func, grid, block, shared memory, params, extra, kern, ctx
    assert [getattr(KernelNodeParams, f).offset for f in ("grid", "shared", "params", "kern", "ctx")] == [
        8, 32, 40, 56, 64,
    ]  # fmt: skip
    assert ctypes.sizeof(KernelNodeParams) == 72


def own_triton_kernels() -> dict[str, bool]:
    """Every Triton kernel of minisgl.kernel launched through a Launcher: whether it takes the PDL parameter."""
    found = {}
    for info in pkgutil.iter_modules(minisgl.kernel.__path__, "minisgl.kernel."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, Launcher):
                fn = value.fn
                found[fn.__name__] = "PDL" in fn.arg_names
    return found


def test_own_waiters_are_exactly_the_kernels_that_wait() -> None:
    waits = name_matcher(OWN_WAITERS)
    kernels = own_triton_kernels()
    assert "_rope_kernel" in kernels and "_sample_chunk_kernel" in kernels
    for name, has_wait in kernels.items():
        assert waits(name) == has_wait, name
    # the CUDA decode kernels wait (decode_common.cuh) under every name they are built with
    cuda_names = [kernel_name(g, v, fp8) for g in (1, 2) for v in VARIANTS for fp8 in (True, False)]
    cuda_names += [
        tc_kernel_name(g, v, fp8)
        for g in TensorCoreDecode.GROUPS
        for v in (*TC_VARIANTS, *TC_BF16_VARIANTS)
        for fp8 in (True, False)
    ]
    assert all(waits(n) for n in cuda_names)
    assert not name_matcher("")("_rope_kernel")


def test_edges_only_for_models_of_short_products() -> None:
    from torch import nn

    from minisgl.engine.graph_edges import MAX_SHORT_PRODUCT, graph_pattern, short_products
    from minisgl.layers.embedding import ParallelLMHead
    from minisgl.layers.linear import LinearReplicated

    with torch.device("meta"):  # one rank (the default): the LM head whole
        # a Qwen3-0.6B-sized layer's largest product (gate|up, 6M elements) beside a 151,936-token LM head
        small = nn.ModuleList([LinearReplicated(1024, 6144), ParallelLMHead(151936, 1024)])
        # a Llama-3-8B-sized o projection (16M)
        large = nn.ModuleList([LinearReplicated(1024, 6144), LinearReplicated(4096, 4096)])
    assert 6144 * 1024 <= MAX_SHORT_PRODUCT < 4096 * 4096
    assert short_products(small) and not short_products(large)
    assert not short_products(nn.Linear(2, 2))  # no layer of this project's: nothing known, no edges
    assert graph_pattern(1, False) == "" and graph_pattern(10_000, True) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("wait", [False, True])
def test_a_programmatic_edge_is_safe_only_into_a_waiting_kernel(wait: bool) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmark" / "offline"))
    from graph_pdl import _copy, _late_write, replay_graph

    n = 1 << 20
    x = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros_like(x)

    def fn() -> None:
        _late_write[(n // 1024,)](x, n, 20000, BLOCK=1024)
        _copy[(n // 1024,)](x, y, n, WAIT=wait, BLOCK=1024)

    g, report = replay_graph(fn, lambda name: "_copy" in name)
    assert report.made_programmatic == 1
    x.zero_()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    # the copy that waits reads the ones; the one that does not reads the zeros before they are written
    assert bool((y == 1).all()) == wait


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_programmatic_edges_into_own_kernels_keep_transformers_tokens(
    variant: str, level: int, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    from tiny import random_prompts

    from minisgl.core import SamplingParams

    monkeypatch.setattr(ENV.GRAPH_PDL, "value", OWN_WAITERS)
    monkeypatch.setattr(ENV.PDL_KERNELS, "value", level)
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tiny_model(variant)
    prompts = random_prompts(11, seed=5, max_len=60)
    llm = make_llm(folder, device="cuda", max_running_req=8, page_size=16, max_extend_tokens=96)
    assert llm.engine.graph_runner.graphs
    out = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 10)
