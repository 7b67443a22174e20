"""Attention of fresh prompts over their own q|k|v rows (kernel/fresh_attention.py): against a causal reference a
request at a time and against the paged extend kernel over a pool holding the same keys; in Triton's interpreter
without a GPU (float32 tiles), compiled on one (bf16, the engine's tiles); and the engine with it on against it off."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from interpreter import CUDA, DEVICE
from tiny import assert_nothing_held, random_prompts

from minisgl.attention import triton_backend
from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernel import fresh_attention as fresh_module
from minisgl.kernel.attention import SHORT_QUERIES, extend_attention
from minisgl.kernel.fresh_attention import fresh_attention, takes
from minisgl.llm import LLM

# the interpreter's products of bf16 tiles are wrong (Triton 3.9), so without a GPU the tiles are float32
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _step(
    lens: list[int], hq: int, hk: int, d: int, extra: int = 0, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """A step's q|k|v rows (`extra` rows after the prompts' stand for a mixed step's decode rows) and its q, k, v
    views, the prompts' starts and lengths."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + extra
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * 2).to(DTYPE).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    qlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, starts, qlens


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Each request's causal attention over its own keys, in float32."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(out)


CASES = [
    ([1, 5, 70, 33, 130], 4, 2, 64, 0),  # lengths within, at and past one tile; a group of 2
    ([200], 8, 2, 128, 0),  # one prompt, a group of 4, the head size of the large models
    ([17, 64, 3], 2, 2, 64, 7),  # no groups; decode rows after the prompts (a mixed step)
]
if CUDA:  # the engine's tiles on long prompts, and a prefill step of the workload's lengths
    CASES += [([1000, 3000, 129, 128, 127, 1], 16, 8, 128, 0), ([8192], 32, 8, 128, 0)]


@pytest.mark.parametrize("lens,hq,hk,d,extra", CASES)
def test_fresh_prompts_attend_to_their_own_keys_as_the_reference_and_the_extend_kernel_do(
    lens: list[int], hq: int, hk: int, d: int, extra: int
) -> None:
    q, k, v, starts, qlens = _step(lens, hq, hk, d, extra)
    assert takes(q, k, v)
    out = fresh_attention(q, k, v, starts, qlens, max(lens), d**-0.5)
    n = sum(lens)
    want = _reference(q, k, v, lens)
    # bf16: the output's rounding and P's (the extend kernel's bound in test_triton_kernels.py)
    tol = 1e-4 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n].float(), want, rtol=tol, atol=tol)
    # the pool path over the same keys, each request's slots scattered: the same tiles' sums
    pool = torch.randperm(n + 9, generator=torch.Generator().manual_seed(1))[:n].to(DEVICE)
    k_cache = torch.zeros(n + 9, hk, d, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_cache[pool], v_cache[pool] = k[:n], v[:n]
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=DEVICE)
    for i, (s, m) in enumerate(zip(starts.tolist(), lens)):
        table[i, :m] = pool[s : s + m].to(torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    paged = extend_attention(q[:n], k_cache, v_cache, table, rows, qlens, starts, qlens, max(lens), d**-0.5)
    torch.testing.assert_close(out[:n].float(), paged.float(), rtol=tol, atol=tol)


def test_views_the_boxes_cannot_take_are_refused() -> None:
    q, k, v, _, _ = _step([4], 2, 2, 64)
    assert takes(q, k, v)
    q80, k80, v80, _, _ = _step([4], 2, 2, 80)
    assert not takes(q80, k80, v80)  # a head size the boxes do not take (not a power of two)
    assert not takes(q, k.transpose(0, 1).contiguous().transpose(0, 1), v)  # a token's heads not one run
    assert not takes(q, k.to(torch.float16), v)  # mixed dtypes


@pytest.mark.parametrize("fresh", [True, False])
def test_the_engine_gives_the_same_tokens_with_the_fresh_prompt_kernel_and_without(
    fresh: bool, tiny_model: Callable[[str], str], hf_reference: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's layers (under the interpreter without a GPU): prompts prefilled whole, and cut into chunks
    (a first chunk is fresh, a later one has a cached prefix and takes the extend kernel), with the folded norms' row
    scale (v scaled in place by the rotary kernel); greedy tokens equal transformers' either way."""
    if not CUDA:
        monkeypatch.setenv("MINISGL_KERNELS", "triton")
        monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.FRESH_PREFILL, "value", 1 if fresh else 0)
    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return fresh_attention(*args)

    monkeypatch.setattr(fresh_module, "fresh_attention", counted)
    folder = tiny_model("qwen3")
    # a budget of 320 tokens a step: the first prompt and 20 tokens of the second (both fresh, the first longer than
    # the extend kernel's short prompts, SHORT_QUERIES), then the second's other 180 (after a cached prefix) beside
    # the third's first 140 (a step not all fresh: the extend kernel), then the third's last 60
    prompts = [p[:n] for p, n in zip(random_prompts(3, seed=8, min_len=300, max_len=300), [300, 200, 200])]
    assert 140 > SHORT_QUERIES
    # eager prefill steps: a prefill graph's replay runs the extend kernel it captured
    llm = LLM(
        folder, dtype=torch.float32, max_running_req=4, max_extend_tokens=320, cache_type="naive",
        cuda_graph_max_prefill=0,
    )  # fmt: skip
    calls.clear()  # the warm-up's
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
    # on: the first step took it, a layer a call; off: the extend kernel alone
    assert len(calls) == (llm.engine.model_config.num_layers if fresh else 0), calls


@pytest.mark.parametrize("fresh_prompts", [(0, 1, 2, 3, 4), (0, 2, 3), (1, 3), ()])
def test_a_prefill_step_takes_the_fresh_prompt_kernel_only_where_every_request_is_fresh(
    fresh_prompts: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that also continues a prompt after a cached prefix keeps the extend kernel for all of its requests
    (docs/benchmarks.md: sending that request alone to the extend kernel, after the fresh kernel, was slower), as
    does a step of fresh prompts no longer than the extend kernel's short tiles take."""
    from types import SimpleNamespace

    from minisgl.core import Batch, Req

    monkeypatch.setattr(ENV.FRESH_PREFILL, "value", 1)
    monkeypatch.setattr(ENV.DECODE_CUDA, "value", False)
    pool = SimpleNamespace(head_dim=64, dtype=torch.float32, num_layers=0)
    backend = triton_backend.TritonAttnBackend(pool, torch.zeros(8, 600), torch.device("cpu"))  # type: ignore[arg-type]
    assert backend.fresh_prefill
    for lengths in ([300, 20, 150, 5, 200], [100, 20, 128, 5, 60]):
        reqs = [
            Req(
                input_ids=[1] * n,
                table_idx=i + 2,
                cached_len=0 if i in fresh_prompts else n // 2,
                output_len=1,
                uid=i,
                sampling_params=SamplingParams(),
                cache_handle=None,
                seed=i,
            )
            for i, n in enumerate(lengths)
        ]
        batch = Batch(reqs=reqs, phase="prefill")
        backend.prepare_metadata(batch)
        q_lens = [r.extend_len for r in reqs]
        starts = [sum(q_lens[:i]) for i in range(len(reqs))]
        assert batch.attn_metadata.packed.tolist() == [[r.table_idx for r in reqs], lengths, starts, q_lens]
        every = len(fresh_prompts) == len(reqs)
        assert batch.attn_metadata.fresh == (every and max(lengths) > SHORT_QUERIES)
