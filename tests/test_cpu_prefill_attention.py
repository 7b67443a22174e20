"""The CPU prefill-attention kernel: causal attention of a packed batch over the paged pool.

Each request's query rows attend over its cached prefix and its own rows up to themselves, read in
place through the page table. The kernel must give what causal attention in float64 gives over the
same pool data: for page sizes 1 and 16, requests with no prefix, one query row, and more rows and
keys than a tile holds (not a multiple of it), one, three and four query heads a KV head, head_dim
64 and 128, float32, bf16 and FP8 pools; with bf16 queries over a bf16 pool, the probabilities rounded to
bf16 for their product with V, as torch's SDPA does. Its plain-C paths give the vector paths' results to
the bit. In the engine, the greedy tokens are those of the torch prefill path it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_kernels
from minisgl.llm import LLM

LIB = cpu_kernels.library()
needs_kernel = pytest.mark.skipif(
    LIB is None, reason="no C compiler here: the CPU kernels could not be built"
)

# (cached prefix, query rows) of each request; tiles are 512 keys and up to 32 query tokens
REQUESTS = [(0, 1), (0, 70), (5, 64), (130, 3), (0, 200), (77, 131), (300, 1), (16, 33), (500, 100)]
WIDTH = 608  # page-table columns: every request's context fits


def _pool(
    page_size: int, num_kv: int, head_dim: int, kv_dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page table, rows, K pool, V pool): each request's context in scattered whole pages, its table
    row not its batch index, and every slot past a request's context NaN, so a read of one shows."""
    n = len(REQUESTS)
    pages = torch.randperm(n * WIDTH // page_size, generator=gen).view(n, WIDTH // page_size)
    table = (pages[:, :, None] * page_size + torch.arange(page_size)).reshape(n, WIDTH).to(torch.int32)
    rows = torch.randperm(n, generator=gen)
    table[rows] = table.clone()
    # FP8 codes cover their range: values around 50 stored, read back times a scale of 0.02
    spread = 50.0 if kv_dtype == torch.float8_e4m3fn else 1.0
    k = torch.randn(n * WIDTH, num_kv, head_dim, generator=gen) * spread
    v = torch.randn(n * WIDTH, num_kv, head_dim, generator=gen) * spread
    for (prefix, extend), row in zip(REQUESTS, rows.tolist()):
        unused = table[row, prefix + extend :].long()
        k[unused] = float("nan")
        v[unused] = float("nan")
    return table, rows, k.to(kv_dtype), v.to(kv_dtype)


def _reference(q, k_cache, v_cache, table, rows, scale, k_scale, v_scale) -> torch.Tensor:  # noqa: ANN001
    """Causal attention in float64 over each request's slots, one request at a time.

    With bf16 queries over a bf16 pool, the probabilities of each block of 512 keys, exp(score - the
    running maximum), are rounded to bf16 before their product with V, as torch's SDPA (and the
    kernel) do; the sum they are divided by is of the unrounded ones.
    """
    round_p = q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
    out, start = [], 0
    group = q.shape[1] // k_cache.shape[1]
    for (prefix, extend), row in zip(REQUESTS, rows.tolist()):
        slots = table[row, : prefix + extend].long()
        k = (k_cache[slots].double() * k_scale).repeat_interleave(group, 1).transpose(0, 1)
        v = (v_cache[slots].double() * v_scale).repeat_interleave(group, 1).transpose(0, 1)
        qb = q[start : start + extend].double().transpose(0, 1)
        scores = qb @ k.transpose(1, 2) * scale
        seen = torch.arange(prefix + extend)[None, :] <= prefix + torch.arange(extend)[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        m = torch.full(scores.shape[:2] + (1,), float("-inf"), dtype=torch.float64)
        total = torch.zeros_like(m)
        acc = torch.zeros(qb.shape, dtype=torch.float64)
        for lo in range(0, prefix + extend, 512):
            block = scores[:, :, lo : lo + 512]
            m_new = torch.maximum(m, block.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(block - m_new)
            total = total * alpha + p.sum(-1, keepdim=True)
            if round_p:
                p = p.to(torch.bfloat16).double()
            acc = acc * alpha + p @ v[:, lo : lo + 512]
            m = m_new
        out.append((acc / total).transpose(0, 1))
        start += extend
    return torch.cat(out)


def _inputs(
    page_size: int, heads: tuple[int, int], head_dim: int, kv_dtype: torch.dtype, q_dtype: torch.dtype
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(page_size * 1000 + heads[0] * 10 + head_dim)
    num_q, num_kv = heads
    table, rows, k_cache, v_cache = _pool(page_size, num_kv, head_dim, kv_dtype, gen)
    tokens = sum(e for _, e in REQUESTS)
    # the queries as the model hands them over: a view of a wider q|k|v row, tokens strided
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(q_dtype)
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    fp8 = kv_dtype == torch.float8_e4m3fn
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=table,
        rows=rows,
        prefix_lens=torch.tensor([p for p, _ in REQUESTS]),
        extend_lens=torch.tensor([e for _, e in REQUESTS]),
        scale=head_dim**-0.5,
        k_scale=0.02 if fp8 else 1.0,
        v_scale=0.03 if fp8 else 1.0,
    )


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["group1", "group3", "group4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "kv_dtype,q_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),
    ],
    ids=["f32", "bf16", "bf16-pool-f32-q", "fp8"],
)
def test_prefill_attention_matches_causal_attention_in_float64(
    page_size: int, heads: tuple[int, int], head_dim: int, kv_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    args = _inputs(page_size, heads, head_dim, kv_dtype, q_dtype)

    out = cpu_kernels.prefill_attention(LIB, **args)

    expected = _reference(
        args["q"], args["k_cache"], args["v_cache"], args["page_table"], args["rows"],
        args["scale"], args["k_scale"], args["v_scale"],
    )  # fmt: skip
    assert out.dtype == q_dtype and out.shape == args["q"].shape
    if q_dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        # float32 inside, one rounding to bf16 at the end: within one bf16 step of the exact value
        torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=2**-8)


@needs_kernel
@pytest.mark.parametrize(
    "extra_flags",
    [["-mno-avx512bf16"], ["-mno-avx512f", "-Wno-psabi"]],
    ids=["without-avx512bf16", "without-avx512"],
)
def test_the_plain_c_paths_give_the_vector_paths_results_to_the_bit(tmp_path, extra_flags: list[str]) -> None:
    plain = cpu_kernels.load(tmp_path, extra_flags)
    for kv_dtype, q_dtype in [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),
    ]:
        args = _inputs(16, (9, 3), 64, kv_dtype, q_dtype)
        fast = cpu_kernels.prefill_attention(LIB, **args)
        assert torch.equal(cpu_kernels.prefill_attention(plain, **args), fast), (kv_dtype, q_dtype)


@needs_kernel
def test_a_head_dim_the_kernel_does_not_take_is_refused() -> None:
    args = _inputs(1, (2, 1), 64, torch.float32, torch.float32)
    args["q"] = args["q"][..., :24].contiguous()
    args["k_cache"] = args["k_cache"][..., :24].contiguous()
    args["v_cache"] = args["v_cache"][..., :24].contiguous()
    with pytest.raises(ValueError, match="head_dim % 16 == 0"):
        cpu_kernels.prefill_attention(LIB, **args)


# Engine level: the same requests with the C prefill and with the torch backend's (the kernel switched off
# on the backend), first a batch of new prompts (one request chunked where max_extend_tokens is small),
# then prompts that extend a cached prefix.
def _tokens(
    make: Callable[[], LLM], in_c: bool, prompts: list[Any], shared: list[Any], max_tokens: int
) -> list[list[int]]:
    llm = make()
    try:
        backend = llm.engine.attn_backend
        assert backend.prefill_in_c
        backend.prefill_in_c = in_c
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        first = llm.generate(prompts, params)
        second = llm.generate(shared, params)
        assert all(o["cached_tokens"] > 0 for o in second)
        assert_nothing_held(llm)
        return [o["token_ids"] for o in first + second]
    finally:
        llm.shutdown()


def _prompts(seed: int, max_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """New prompts of 1 to max_len tokens, and three that extend the longest of them by 1, 40 and 130."""
    prompts = random_prompts(5, seed=seed, min_len=1, max_len=max_len) + [
        random_prompts(1, seed=seed, min_len=1, max_len=1)[0]
    ]
    longest = max(prompts, key=len)
    tails = random_prompts(3, seed=seed + 1, min_len=130, max_len=130)
    return prompts, [longest + t[:n] for t, n in zip(tails, (1, 40, 130))]


@needs_kernel
@pytest.mark.parametrize(
    "options",
    [dict(), dict(page_size=16, max_extend_tokens=100), dict(kv_cache_dtype="fp8")],
    ids=["page1", "page16-chunked", "fp8"],
)
def test_the_default_model_in_float32_decodes_the_torch_paths_tokens(options: dict[str, Any]) -> None:
    prompts, shared = _prompts(seed=3, max_len=300)

    def make() -> LLM:
        return LLM(None, dtype=torch.float32, max_running_req=4, **options)

    assert _tokens(make, True, prompts, shared, 24) == _tokens(make, False, prompts, shared, 24)


# In bf16 the kernel computes what SDPA computes (probabilities rounded to bf16 for the product with V), and
# 98% of its outputs equal SDPA's bit for bit (500 tokens of random data); the rest differ by a bf16 step,
# which a near-tie of the logits turns into another token: text meets such ties after a few tokens at
# times (as the torch path alone does between a whole prefill and a chunked one). Hence the default chat
# answers in full, and text for the first 4 tokens.
TEXT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "A paged KV cache hands out pages as requests grow and takes them back when they finish; "
    "a radix tree keeps the prefixes that several prompts share. " * 4,
]
QUESTIONS = ["What is the capital of France?", "Name three prime numbers."]


def _chat_answers(in_c: bool) -> list[str]:
    llm = LLM(None, max_running_req=4)
    try:
        llm.engine.attn_backend.prefill_in_c = in_c
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        return [o["text"] for o in llm.chat(chats, SamplingParams(max_tokens=32, temperature=0.0))]
    finally:
        llm.shutdown()


@needs_kernel
def test_the_default_model_in_bf16_gives_the_torch_paths_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 batches, not the default's W8A8 ones: rounding activations to int8 turns the kernels' bf16-step
    # differences into whole int8 steps, and the shared prompts' tokens parted at the first one (measured)
    monkeypatch.setattr(ENV.CPU_W8A8_BATCHES, "value", False)
    answers = _chat_answers(True)
    assert answers[0] == "The capital of France is Paris."
    assert answers == _chat_answers(False)

    def make() -> LLM:
        return LLM(None, max_running_req=4)

    shared = [TEXT[-1] + tail for tail in (" Why?", " What does the tree keep, and why?")]
    assert _tokens(make, True, TEXT, shared, 4) == _tokens(make, False, TEXT, shared, 4)


@needs_kernel
def test_a_tiny_gqa_model_decodes_the_torch_paths_tokens(tiny_model: Callable[[str], str]) -> None:
    # float32: in bf16 this model's random weights meet a near-tie within 16 tokens (one request of eight)
    folder = tiny_model("llama")  # 4 query heads on 2 KV heads, head_dim 16
    prompts, shared = _prompts(seed=11, max_len=200)

    def make() -> LLM:
        return LLM(folder, dtype=torch.float32, max_running_req=4, page_size=4)

    assert _tokens(make, True, prompts, shared, 16) == _tokens(make, False, prompts, shared, 16)


def test_a_head_dim_not_a_multiple_of_16_prefills_with_torch(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("qwen3-mqa-head-dim"), max_running_req=2)  # head_dim 24
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 3
    assert not getattr(llm.engine.attn_backend, "prefill_in_c", False)
