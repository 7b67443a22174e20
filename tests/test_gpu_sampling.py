"""The CUDA sampling path inside the overlap loop, and the start-up warm-up: run with `pytest -m gpu`.

- A batch of top-k / top-p / min-p rows beside greedy ones decodes without one host synchronisation:
  torch's sync debug mode turns any into an error during the steady-state decode steps.
- Seeded tokens do not depend on CUDA graphs or on the overlap loop.
- After `LLM(...)` returns, a workload of every sampling mode, many prompt lengths and batch sizes
  compiles no Triton kernel: the warm-up (engine/warmup.py) compiled every variant it reaches. So do
  decode batches of every size that run eagerly: without graphs, or above the largest graph.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
from tiny import random_prompts

from minisgl.core import Batch, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def filtered_and_greedy(n: int, max_tokens: int = 24) -> list[SamplingParams]:
    modes: list[dict[str, Any]] = [
        dict(temperature=0.8, top_k=50),
        dict(),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, min_p=0.05),
        dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02),
        dict(temperature=0.6),
    ]
    return [
        SamplingParams(max_tokens=max_tokens - i % 5, ignore_eos=True, seed=i, **modes[i % len(modes)])
        for i in range(n)
    ]


@pytest.fixture
def overlap_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", False)


class DecodeSyncCheck:
    """A step observer: from the second decode step of a run of decode steps on, any host synchronisation
    (.item(), a blocking copy, a synchronize call) raises, until the next prefill or idle step."""

    def __init__(self) -> None:
        self.run = 0
        self.checked = 0

    def __call__(self, batch: Batch | None) -> None:
        if batch is None or batch.is_prefill:
            self.run = 0
            torch.cuda.set_sync_debug_mode("default")
            return
        self.run += 1
        if self.run >= 2:
            self.checked += 1
            torch.cuda.set_sync_debug_mode("error")


def test_filtered_rows_beside_greedy_ones_decode_without_a_host_sync(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], overlap_on: None
) -> None:
    llm = make_llm(tiny_model("qwen3"), device="cuda", max_running_req=8)
    assert llm.engine.graph_runner.graphs
    prompts = random_prompts(12, seed=3, max_len=40)
    check = DecodeSyncCheck()
    llm.step_observers.append(check)
    try:
        out = llm.generate(prompts, filtered_and_greedy(12))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [o["finish_reason"] for o in out] == ["length"] * 12
    assert check.checked > 20  # most of the ~40 decode steps ran under the check
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [True, False])
def test_seeded_filtered_tokens_are_the_same_with_graphs_on_and_off(
    overlap: bool,
    tiny_model: Callable[[str], str],
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not overlap)
    folder = tiny_model("qwen3")
    prompts = random_prompts(10, seed=8, max_len=40)
    params = filtered_and_greedy(10)
    tokens = {}
    for graphs in (True, False):
        llm = make_llm(folder, device="cuda", max_running_req=4, cuda_graph_max_bs=None if graphs else 0)
        assert bool(llm.engine.graph_runner.graphs) == graphs
        tokens[graphs] = [o["token_ids"] for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert tokens[True] == tokens[False]
    # the filters really sampled: a seed changes the sampled rows' tokens, never the greedy ones'
    llm = make_llm(folder, device="cuda", max_running_req=4)
    reseeded = [replace(p, seed=i + 100) for i, p in enumerate(params)]
    again = [o["token_ids"] for o in llm.generate(prompts, reseeded)]
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert [again[i] for i in greedy] == [tokens[True][i] for i in greedy]
    assert again != tokens[True]


def compiled_variants() -> int:
    """Triton kernels compiled so far for the project's @triton.jit functions (all devices)."""
    from triton.runtime.jit import JITFunction

    import minisgl.kernel
    from minisgl.kernel.launch import Launcher

    total = 0
    for info in pkgutil.iter_modules(minisgl.kernel.__path__):
        module = importlib.import_module(f"minisgl.kernel.{info.name}")
        for fn in vars(module).values():
            fn = fn.fn if isinstance(fn, Launcher) else fn  # the kernels launched through a Launcher
            if isinstance(fn, JITFunction):
                # triton keeps (kernel cache, ...) per device; the first item maps keys to kernels
                total += sum(len(c[0] if isinstance(c, tuple) else c) for c in fn.device_caches.values())
    return total


@contextmanager
def compilations() -> Iterator[list[str]]:
    """The names of the kernels Triton compiles inside the block (its post-compile hook, triton >= 3.4)."""
    import triton

    names: list[str] = []
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        yield names
        return

    def hook(*args: Any, **kwargs: Any) -> bool:
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", repr(fn)))
        return False

    old = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        runtime.jit_post_compile_hook = old


def every_mode(n: int) -> list[SamplingParams]:
    modes: list[dict[str, Any]] = [
        dict(),
        dict(temperature=0.7),
        dict(temperature=0.7, top_k=40),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=1.1, top_k=200, top_p=0.95, min_p=0.01),
        dict(presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0.8, repetition_penalty=1.2),
        dict(logit_bias={5: -100.0, 7: 2.0}),
        dict(logprobs=3),
        dict(temperature=0.5, prompt_logprobs=2),
        dict(temperature=0.9, min_tokens=6, stop_token_ids=[3]),
    ]
    return [SamplingParams(max_tokens=4 + i % 13, seed=i, **modes[i % len(modes)]) for i in range(n)]


@pytest.mark.parametrize("variant", ["qwen3", "qwen3-moe"])
def test_a_workload_after_start_up_compiles_no_triton_kernel(
    variant: str, tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], overlap_on: None
) -> None:
    llm = make_llm(tiny_model(variant), device="cuda", max_running_req=16, max_extend_tokens=512)
    compiled = compiled_variants()
    assert compiled > 0  # the warm-up and the graph capture compiled the kernels
    # the tiny models take 512 positions: prompt and output stay within them
    lengths = [1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 64, 100, 127, 200, 300, 480]
    prompts = [p[:n] for p, n in zip(random_prompts(40, seed=11, min_len=600, max_len=700), lengths * 3)]
    with compilations() as names:
        # batches of every size up to 16 in decode, prefills of 1 to 16 requests (and chunked ones)
        llm.generate(prompts, every_mode(len(prompts)))
        llm.generate(prompts[:5], SamplingParams(max_tokens=9, temperature=0.7))
        llm.generate(prompts[5:9], SamplingParams(max_tokens=9))
        # a shared prefix: extend steps over a cached prefix
        llm.generate([prompts[-1] + [3, 4], prompts[-1] + [5]], SamplingParams(max_tokens=3))
    assert names == [] and compiled_variants() == compiled, f"compiled after start-up: {names}"
    llm.check_integrity()


@pytest.mark.parametrize("graphs_max_bs", [0, 8])
def test_eager_decode_batches_after_start_up_compile_no_triton_kernel(
    graphs_max_bs: int, tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], overlap_on: None
) -> None:
    # bf16, as a served model runs; 40 rows cross the longest-first order (32) and many split counts
    llm = make_llm(
        tiny_model("qwen3"),
        device="cuda",
        dtype=torch.bfloat16,
        max_running_req=40,
        max_extend_tokens=2048,
        cuda_graph_max_bs=graphs_max_bs,
    )
    prompts = random_prompts(40, seed=5, min_len=3, max_len=40)
    with compilations() as names:
        # one prefill of the 40, then decode batches of 39, 38, ..., 1 rows as the requests finish
        outs = llm.generate(prompts, [SamplingParams(max_tokens=1 + i, ignore_eos=True) for i in range(40)])
    assert names == [], f"compiled after start-up: {names}"
    assert [len(o["token_ids"]) for o in outs] == [1 + i for i in range(40)]
    llm.check_integrity()


def test_bf16_prompts_past_the_short_tiles_after_start_up_compile_no_triton_kernel(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], overlap_on: None
) -> None:
    # eager prefill steps (no prefill graphs) of fresh prompts and of chunks after a cached prefix, each with more
    # new tokens than the extend kernel's short tiles take: the fresh-prompt kernel and the extend kernel's long
    # tiles, both compiled by the warm-up
    llm = make_llm(
        tiny_model("qwen3"), device="cuda", dtype=torch.bfloat16, max_running_req=8, max_extend_tokens=384,
        cuda_graph_max_prefill=0,
    )  # fmt: skip
    prompts = random_prompts(6, seed=12, min_len=200, max_len=480)
    with compilations() as names:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert names == [], f"compiled after start-up: {names}"
    assert [len(o["token_ids"]) for o in outs] == [4] * 6
    llm.check_integrity()


def test_the_fused_head_draws_what_the_product_then_the_sampler_draw(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode graphs' plain batches through the fused LM head and sampling (engine/fused_head.py), against
    the same engine with the LM head's product and the sampling kernel."""
    folder = tiny_model("qwen3")
    prompts = random_prompts(16, seed=5, max_len=40)
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 0.7)
        for i in range(16)
    ]
    tokens, fused_steps = {}, 0
    for fused in (True, False):
        monkeypatch.setattr(ENV.FUSED_SAMPLING, "value", 128 if fused else 0)
        llm = make_llm(folder, device="cuda", max_running_req=16)
        head = llm.engine.fused_head
        assert (head is not None) == fused
        if head is not None:

            def counted(*args: Any, sample: Callable[..., torch.Tensor] = head.sample) -> torch.Tensor:
                nonlocal fused_steps
                fused_steps += 1
                return sample(*args)

            monkeypatch.setattr(head, "sample", counted)
        tokens[fused] = [o["token_ids"] for o in llm.generate(prompts, params)]
        llm.check_integrity()
        llm.shutdown()
    assert fused_steps >= 15  # the decode steps after the first took the fused kernel
    # float32 sums in another order than cuBLAS's: a near tie may go the other way, rarely
    same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
    assert same >= 15, (tokens[True], tokens[False])
    # logprobs need the logits: such a batch takes the product, and its logprobs are the product's
    monkeypatch.setattr(ENV.FUSED_SAMPLING, "value", 128)
    llm = make_llm(folder, device="cuda", max_running_req=16)
    out = llm.generate(prompts[:4], [replace(p, logprobs=2) for p in params[:4]])
    assert all(len(o["logprobs"]) == 20 for o in out)
