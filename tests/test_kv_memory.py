"""KV memory: the prefix cache, chunked prefill, admission under memory pressure, abort, and the figures.

Every test compares greedy tokens with transformers' and ends with every table row free and every KV
page free or cached (the scheduler also checks its page accounting after every step here).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tiny import assert_nothing_held, random_prompts

from minisgl.core import Batch, ChunkedReq, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM
from minisgl.scheduler.prefill import PromptHeads

BIG_BUDGET = 8192


@pytest.fixture(autouse=True)
def check_integrity_every_step() -> Iterator[None]:
    old = ENV.DEBUG_CHECK_INTEGRITY.value
    ENV.DEBUG_CHECK_INTEGRITY.value = True
    yield
    ENV.DEBUG_CHECK_INTEGRITY.value = old


@pytest.fixture
def llama(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture
def build(make_llm: Callable[..., LLM]) -> Callable[..., LLM]:
    """make_llm whose generate fails, rather than spinning forever, when nothing can be scheduled."""

    def make(folder: str, **kwargs: Any) -> LLM:
        llm = make_llm(folder, **kwargs)
        idle = [0]

        def guarded(batch: Batch | None) -> None:
            idle[0] = 0 if batch is not None else idle[0] + 1
            assert idle[0] < 1000, "requests are waiting but none is ever admitted"

        llm.step_observers.append(guarded)
        return llm

    return make


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def on_forward(llm: LLM, action: Callable[[Batch], None]) -> None:
    """Call action(batch) before every forward pass of llm (to abort a request at a chosen step)."""
    llm.step_observers.append(lambda batch: batch is not None and action(batch))


def assert_no_cache_locks(llm: LLM) -> None:
    cache = llm.cache_manager.prefix_cache
    assert cache.evictable_pages == cache.total_pages


_BASE = random_prompts(1, seed=7, min_len=60, max_len=60)[0]
_OTHER = random_prompts(4, seed=8, min_len=1, max_len=70)
# prompts sharing a long prefix, prompts that are prefixes of each other, a repeated prompt, unrelated ones
PROMPTS = [
    _BASE[:40] + [5, 6, 7],
    _BASE[:40] + [8, 9],
    _BASE[:20],
    _BASE[:21],
    _BASE,
    _BASE,
    *_OTHER,
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("max_extend_tokens", [BIG_BUDGET, 64, 16])
@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_prefix_cache_and_chunked_prefill_give_transformers_tokens(
    llama, build, hf_reference, cache_type, max_extend_tokens, page_size
):
    llm = build(
        llama,
        cache_type=cache_type,
        page_size=page_size,
        max_extend_tokens=max_extend_tokens,
        max_running_req=8,
    )
    ref = hf_reference(llama, PROMPTS, 6)
    for run in range(2):  # the second run finds every prompt in the cache
        before = llm.cache_stats.prompt_tokens, llm.cache_stats.cached_tokens
        out = llm.generate(PROMPTS, greedy(6))
        assert [o["token_ids"] for o in out] == ref
        assert all(o["finish_reason"] == "length" for o in out)
        assert [o["prompt_tokens"] for o in out] == [len(p) for p in PROMPTS]
        cached = [o["cached_tokens"] for o in out]
        # a chunked prompt is counted once, when its last chunk is done
        assert llm.cache_stats.prompt_tokens - before[0] == sum(len(p) for p in PROMPTS)
        assert llm.cache_stats.cached_tokens - before[1] == sum(cached)
        if cache_type == "naive":
            assert cached == [0] * len(PROMPTS)
        elif run == 1:  # the whole prompt but its last token, in whole pages
            assert cached == [(len(p) - 1) // page_size * page_size for p in PROMPTS]
        assert_nothing_held(llm)
        assert_no_cache_locks(llm)


def test_shared_system_prompt_is_computed_once_with_radix(llama, build, hf_reference):
    system = random_prompts(1, seed=11, min_len=300, max_len=300)[0]
    prompts = [system + q for q in random_prompts(32, seed=12, min_len=4, max_len=12)]
    computed: dict[str, int] = {}
    for cache_type in ("naive", "radix"):
        llm = build(llama, cache_type=cache_type, max_running_req=32)
        out = llm.generate(prompts, greedy(2))
        assert [o["token_ids"] for o in out] == hf_reference(llama, prompts, 2)
        computed[cache_type] = sum(o["prompt_tokens"] - o["cached_tokens"] for o in out)
        assert llm.cache_stats.computed_tokens == computed[cache_type]
        assert_nothing_held(llm)
    assert computed["naive"] == sum(len(p) for p in prompts)
    assert computed["radix"] <= 0.2 * computed["naive"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_in_batch_prefix_share_computes_a_shared_prefix_once_and_off_computes_it_per_request(
    llama, build, hf_reference, page_size
):
    system = random_prompts(1, seed=11, min_len=100, max_len=100)[0]
    prompts = [system + q for q in random_prompts(8, seed=12, min_len=4, max_len=12)]
    shared = len(system) // page_size * page_size
    # the option -> whether the requests behind the first wait for its KV (the rule counts whole pages)
    waits = {32: True, shared: True, shared + 1: False, 0: False}
    for share, wait in waits.items():
        llm = build(llama, in_batch_prefix_share=share, page_size=page_size, max_running_req=8)
        out = llm.generate(prompts, greedy(4))
        assert [o["token_ids"] for o in out] == hf_reference(llama, prompts, 4)
        # waiting, the 7 behind the first read the prefix from the cache; else all 8 compute it in one batch
        assert [o["cached_tokens"] for o in out] == [0] + [shared if wait else 0] * 7
        assert_nothing_held(llm)
    with pytest.raises(ValueError, match="in_batch_prefix_share"):
        build(llama, in_batch_prefix_share=-1)


def test_prompt_heads_find_what_a_walk_over_the_batch_finds() -> None:
    """PromptHeads (the admitted prompts' heads by length) against comparing the head with every prompt."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4) for _ in range(rng.randint(0, 9))] for _ in range(40)]
    heads = PromptHeads(prompts[:5])
    for i, prompt in enumerate(prompts[5:], start=5):
        for n in range(len(prompt) + 2):
            head = prompt[:n]
            want = any(p[: len(head)] == head for p in prompts[:i])
            assert heads.starts_any(head) == want, (head, i)
        heads.add(prompt)  # admitted after asking, as PrefillAdder does


@pytest.mark.parametrize("max_extend_tokens", [BIG_BUDGET, 16])
@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_workload_many_times_the_pool_completes_in_order(
    llama, build, hf_reference, cache_type, max_extend_tokens
):
    page_size, num_pages = 4, 24
    rng = random.Random(3)
    distinct = [_BASE[:n] for n in (4, 9, 17, 30)] + random_prompts(8, seed=4, min_len=2, max_len=30)
    reqs = [(rng.choice(distinct), rng.randint(1, 10)) for _ in range(120)]
    need = sum(-(-(len(p) + n) // page_size) for p, n in reqs)
    assert need > 10 * num_pages
    llm = build(
        llama,
        cache_type=cache_type,
        page_size=page_size,
        num_page_override=num_pages,
        max_running_req=8,
        max_extend_tokens=max_extend_tokens,
    )
    first_prefill: list[int] = []

    def record(batch: Batch) -> None:
        if batch.is_prefill:
            first_prefill.extend(r.uid for r in batch.reqs if r.uid not in first_prefill)

    on_forward(llm, record)
    out = llm.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs])
    ref = dict(zip(map(tuple, distinct), hf_reference(llama, distinct, 10)))
    assert [o["token_ids"] for o in out] == [ref[tuple(p)][:n] for p, n in reqs]
    assert first_prefill == list(range(len(reqs)))  # first come, first served
    assert_nothing_held(llm)


def test_requests_behind_a_chunked_prompt_leave_it_room_to_finish(llama, build, hf_reference):
    # 20 pages of 4: the chunked prompt needs 15 (40 + 20 tokens), the one behind it 6 (6 + 18); both cannot run
    # at once, though the second one's prompt fits in the budget left beside the first one's last chunk
    prompts = [_BASE[:40], _OTHER[1][:6]]
    max_tokens = [20, 18]
    llm = build(llama, page_size=4, num_page_override=20, max_extend_tokens=16)
    out = llm.generate(prompts, [greedy(n) for n in max_tokens])
    ref = hf_reference(llama, prompts, 20)
    assert [o["token_ids"] for o in out] == [r[:n] for r, n in zip(ref, max_tokens)]
    assert_nothing_held(llm)


def test_request_larger_than_the_pool_gets_an_error_while_others_complete(llama, build, hf_reference):
    page_size, num_pages = 4, 16  # 64 tokens of KV
    prompts = random_prompts(4, seed=21, min_len=30, max_len=30)
    max_tokens = [5, 35, 34, 5]  # 30 + 35 tokens can never fit; 30 + 34 fills the pool exactly
    llm = build(llama, cache_type="radix", page_size=page_size, num_page_override=num_pages)
    out = llm.generate(prompts, [greedy(n) for n in max_tokens])
    assert out[1]["finish_reason"] == "error" and out[1]["token_ids"] == []
    assert "max_tokens" in out[1]["error"]
    ref = hf_reference(llama, prompts, 34)
    for i in (0, 2, 3):
        assert out[i]["finish_reason"] == "length"
        assert out[i]["token_ids"] == ref[i][: max_tokens[i]]
    assert_nothing_held(llm)


@pytest.mark.parametrize("sent", [True, False], ids=["in-scheduler-queue", "not-yet-sent"])
def test_abort_of_a_waiting_request(llama, build, hf_reference, sent):
    prompts = random_prompts(3, seed=31, min_len=20, max_len=20)
    # one table row: the third request waits in the scheduler's queue; a small budget keeps it in LLM's list
    llm = build(llama, max_running_req=1, max_extend_tokens=BIG_BUDGET if sent else 16)

    in_scheduler_queue: list[bool] = []

    def abort_third(batch: Batch) -> None:
        if not in_scheduler_queue:
            in_scheduler_queue.append(any(p.uid == 2 for p in llm.prefill_manager.pending_list))
            llm.abort(2)

    on_forward(llm, abort_third)
    out = llm.generate(prompts, greedy(4))
    assert in_scheduler_queue == [sent]
    assert (out[2]["finish_reason"], out[2]["token_ids"]) == ("abort", [])
    ref = hf_reference(llama, prompts, 4)
    assert [o["token_ids"] for o in out[:2]] == ref[:2]
    assert_nothing_held(llm)


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_mid_chunk_frees_its_pages_and_cache_locks(llama, build, hf_reference, page_size):
    llm = build(llama, cache_type="radix", page_size=page_size, max_extend_tokens=16)
    llm.generate([_BASE[:40]], greedy(1))  # cached: the long prompt below starts from 36+ cached tokens
    long_prompt = _BASE[:40] + random_prompts(1, seed=41, min_len=50, max_len=50)[0]
    prompts = [long_prompt, _OTHER[0]]
    aborted: list[bool] = []

    def abort_mid_chunk(batch: Batch) -> None:
        if not aborted and any(isinstance(r, ChunkedReq) and r.uid == 0 for r in batch.reqs):
            assert llm.cache_manager.prefix_cache.evictable_pages < llm.cache_manager.prefix_cache.total_pages
            llm.abort(0)
            aborted.append(True)

    on_forward(llm, abort_mid_chunk)
    out = llm.generate(prompts, greedy(4))
    assert aborted
    assert (out[0]["finish_reason"], out[0]["token_ids"]) == ("abort", [])
    assert out[1]["token_ids"] == hf_reference(llama, [_OTHER[0]], 4)[0]
    assert_nothing_held(llm)
    assert_no_cache_locks(llm)


@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_abort_while_decoding_keeps_the_tokens_so_far(llama, build, hf_reference, cache_type):
    prompts = random_prompts(3, seed=51, min_len=10, max_len=30)
    llm = build(llama, cache_type=cache_type, page_size=4)
    decode_steps: list[int] = []

    def abort_at_third_decode(batch: Batch) -> None:
        if batch.is_decode:
            decode_steps.append(1)
            if len(decode_steps) == 3:
                llm.abort(1)

    on_forward(llm, abort_at_third_decode)
    out = llm.generate(prompts, greedy(12))
    ref = hf_reference(llama, prompts, 12)
    assert out[1]["finish_reason"] == "abort"
    kept = out[1]["token_ids"]
    # the prefill token and up to three decode steps (the overlap loop is one step behind when the abort lands)
    assert 1 <= len(kept) <= 4 and kept == ref[1][: len(kept)]
    assert [out[0]["token_ids"], out[2]["token_ids"]] == [ref[0], ref[2]]
    assert_nothing_held(llm)
    assert_no_cache_locks(llm)
