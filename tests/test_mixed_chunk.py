"""Mixed steps (SchedulerConfig.enable_mixed_chunk, SGLang's --enable-mixed-chunk): a prefill step also decodes the
running requests, a token each. The tokens are those of steps that only prefill or only decode: greedy ones equal
transformers', sampled ones (seeded), log-probabilities and prompt log-probabilities equal the plain schedule's, in
the plain and the overlap loop, at page sizes 1 and 4; and mixed steps do happen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, mixed_steps, overlap_loop_llm, random_prompts

from minisgl.core import SamplingParams, set_global_ctx
from minisgl.env import ENV
from minisgl.llm import LLM
from minisgl.server.args import parse_args

PROMPTS = random_prompts(10, seed=3, min_len=5, max_len=60)
# few rows and a small prefill budget: prompts wait and are cut into chunks while others decode
ENGINE = dict(max_running_req=4, max_extend_tokens=32, cache_type="naive")


def params(i: int, n: int = 12) -> SamplingParams:
    """Greedy and seeded sampled requests in turn, of different lengths; some with logprobs."""
    kind: dict[str, Any] = {"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i, "top_p": 0.9}
    return SamplingParams(max_tokens=n + i, ignore_eos=True, logprobs=2 if i % 3 == 0 else None, **kind)


@pytest.fixture(autouse=True)
def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)


def outputs(llm: LLM, requests: list[SamplingParams]) -> list[tuple[Any, ...]]:
    out = llm.generate(PROMPTS, requests)
    assert_nothing_held(llm)
    return [(o["token_ids"], o.get("logprobs"), o.get("prompt_logprobs"), o["finish_reason"]) for o in out]


def test_greedy_tokens_in_mixed_steps_are_transformers(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], hf_reference: Any
) -> None:
    path = tiny_model("llama")
    llm = make_llm(path, enable_mixed_chunk=True, **ENGINE)
    seen = mixed_steps(llm)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPTS, greedy)
    assert [o["token_ids"] for o in out] == hf_reference(path, PROMPTS, 12)
    assert sum(n > 0 for n in seen) >= 3, seen  # prefill steps that decoded running requests
    assert_nothing_held(llm)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_steps_give_the_plain_schedules_tokens_and_logprobs(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], page_size: int
) -> None:
    path = tiny_model("qwen3")
    requests = [params(i) for i in range(len(PROMPTS))]
    # a request that asks for its prompt's log-probabilities decodes in mixed steps after its prefill
    requests[4] = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    plain = outputs(make_llm(path, page_size=page_size, enable_mixed_chunk=False, **ENGINE), requests)
    llm = make_llm(path, page_size=page_size, enable_mixed_chunk=True, **ENGINE)
    seen = mixed_steps(llm)
    mixed = outputs(llm, requests)
    for m, p in zip(mixed, plain):
        assert (m[0], m[3]) == (p[0], p[3])  # the tokens and the finish
        assert (m[1] is None) == (p[1] is None)
        for got, want in zip(m[1] or [], p[1] or []):
            assert got == pytest.approx(want, abs=1e-4)
    assert mixed[4][2] is not None and len(mixed[4][2]) == len(PROMPTS[4])
    for got, want in zip(mixed[4][2], plain[4][2]):
        assert got == want if got is None else got == pytest.approx(want, abs=1e-4)
    assert sum(n > 0 for n in seen) >= 3, seen


def test_the_overlap_loop_with_mixed_steps_gives_the_plain_loops_tokens(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model("llama")
    requests = [params(i) for i in range(len(PROMPTS))]
    plain = make_llm(path, enable_mixed_chunk=False, **ENGINE)
    want = [o["token_ids"] for o in plain.generate(PROMPTS, requests)]
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)
    llm = overlap_loop_llm(path, enable_mixed_chunk=True, dtype=torch.float32, **ENGINE)
    try:
        seen = mixed_steps(llm)
        # some requests end on an EOS while the next step (mixed) is already built: their rows there are dropped
        eos_too = [*requests[:5], *(SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(5))]
        assert [o["token_ids"] for o in llm.generate(PROMPTS, requests)] == want
        stopped = llm.generate(PROMPTS, eos_too)
        assert [o["token_ids"] for o in stopped[:5]] == want[:5]
        assert_nothing_held(llm)
        assert sum(n > 0 for n in seen) >= 3, seen
    finally:
        llm.shutdown()
        set_global_ctx(plain.engine.ctx)


def test_the_server_flags_turn_mixed_steps_on_and_off_and_the_default_follows_the_device(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    assert parse_args([]).scheduler_config("a", "b").enable_mixed_chunk is None
    assert parse_args(["--enable-mixed-chunk"]).scheduler_config("a", "b").enable_mixed_chunk is True
    assert parse_args(["--disable-mixed-chunk"]).scheduler_config("a", "b").enable_mixed_chunk is False
    # left to the engine: on on a CPU (measured faster there), off on CUDA (its mixed steps run without graphs)
    for flag in (None, False):
        llm = make_llm(tiny_model("llama"), device="cpu", enable_mixed_chunk=flag, **ENGINE)
        assert llm.config.enable_mixed_chunk is (flag is None)
        seen = mixed_steps(llm)
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        assert_nothing_held(llm)
        assert (sum(n > 0 for n in seen) >= 2) == (flag is None), seen


@pytest.mark.parametrize("kernels", ["auto", "triton", "triton-unsplit", "triton-graphs"])
def test_mixed_steps_at_tp2_and_through_the_cuda_paths_kernels_give_transformers_tokens(
    kernels: str, tiny_model: Callable[[str], str], hf_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank builds the same mixed steps; and the CUDA path's layers under Triton's interpreter (tp=1 there: it is
    slow) run a mixed step's prompts through the extend kernel and its decode rows through the decode kernel, or the
    whole step from a prefill graph where one fits (the graphs emulated)."""
    prompts, steps, extra, tp = PROMPTS[:6], 8, {}, 2
    if kernels.startswith("triton"):
        monkeypatch.setenv("MINISGL_KERNELS", "triton")
        monkeypatch.setattr(ENV.KERNELS, "value", "triton")
        prompts, steps, tp = PROMPTS[:5], 5, 1
    if kernels == "triton-unsplit":  # the decode rows with the prompts through the extend kernel
        monkeypatch.setattr(ENV.MIXED_DECODE_SPLIT, "value", False)
    if kernels == "triton-graphs":
        monkeypatch.setenv("MINISGL_EMULATE_GRAPHS", "1")
        monkeypatch.setattr(ENV.EMULATE_GRAPHS, "value", True)
        extra = dict(cuda_graph_bs=[2, 4], cuda_graph_max_bs=4, cuda_graph_max_prefill=32)
    folder = tiny_model("qwen3")
    engine = {**ENGINE, "max_running_req": 2, "max_extend_tokens": 24}
    llm = LLM(folder, dtype=torch.float32, tp_size=tp, enable_mixed_chunk=True, **engine, **extra)
    try:
        seen = mixed_steps(llm)
        out = llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
        assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, steps)
        assert_nothing_held(llm)
        assert sum(n > 0 for n in seen) >= 2, seen
    finally:
        llm.shutdown()
