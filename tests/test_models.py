"""minisgl's greedy tokens equal transformers' exactly (float32), for every architecture and shape of model.

Each run puts prompts of many lengths into one generate call with different max_tokens and fewer
table rows than prompts, so requests wait, join while others decode, and leave at their own pace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Reference
from tiny import VARIANTS, assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

_BASE = random_prompts(8, seed=1)
# a few prompts repeat or extend earlier ones, so the radix cache has prefixes to serve
PROMPTS = _BASE + [_BASE[1] + [7, 8, 9], list(_BASE[3]), _BASE[5][: len(_BASE[5]) // 2 + 1]]
MAX_TOKENS = [5, 12, 1, 9, 16, 3, 7, 10, 2, 14, 6]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(autouse=True)
def _check_pages_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)


def _expected(reference: Reference, folder: str) -> list[list[int]]:
    ref = reference(folder, PROMPTS, max(MAX_TOKENS))
    return [r[:n] for r, n in zip(ref, MAX_TOKENS)]


CACHES: dict[str, dict[str, Any]] = {"naive": dict(cache_type="naive"), "radix (the default)": {}}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers(
    variant: str,
    cache: str,
    tiny_model: Callable[[str], str],
    hf_reference: Reference,
    make_llm: Callable[..., LLM],
) -> None:
    folder = tiny_model(variant)
    llm = make_llm(folder, max_running_req=4, **CACHES[cache])
    expected = _expected(hf_reference, folder)

    first = llm.generate(PROMPTS, PARAMS)
    assert [o["token_ids"] for o in first] == expected
    assert all(o["finish_reason"] == "length" for o in first)
    assert_nothing_held(llm)

    # the same prompts again: under radix their prefixes now come from the cache
    again = llm.generate(PROMPTS, PARAMS)
    assert [o["token_ids"] for o in again] == expected
    cached = sum(o["cached_tokens"] for o in again)
    assert cached == 0 if cache == "naive" else cached > 0
    assert_nothing_held(llm)


SCHEDULES: dict[str, dict[str, Any]] = {
    "one request at a time": dict(max_running_req=1),
    "all requests at once": dict(max_running_req=16),
    "admission limited by KV pages": dict(max_running_req=8, num_page_override=80),
    "chunked prefill": dict(max_running_req=4, max_extend_tokens=7),
    "pages of 4 tokens, naive": dict(max_running_req=4, page_size=4, cache_type="naive"),
    "pages of 4 tokens, radix": dict(max_running_req=4, page_size=4, cache_type="radix"),
    "pages of 4 tokens, chunked, radix": dict(
        max_running_req=3, page_size=4, max_extend_tokens=10, cache_type="radix"
    ),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_tokens_do_not_depend_on_the_schedule(
    schedule: str, tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    folder = tiny_model("llama")
    llm = make_llm(folder, **SCHEDULES[schedule])
    expected = _expected(hf_reference, folder)
    for _ in range(2):
        out = llm.generate(PROMPTS, PARAMS)
        assert [o["token_ids"] for o in out] == expected
        assert_nothing_held(llm)
