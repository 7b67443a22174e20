"""Bad input gets an explicit answer, the good requests beside it still complete, and nothing is leaked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Reference
from tiny import assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.llm import LLM

GOOD = random_prompts(4, seed=4, min_len=2, max_len=20)
MAX_SEQ_LEN = 64


@pytest.fixture
def llama(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _count_forwards(llm: LLM) -> list[int]:
    """A one-element list holding how many batches the engine has computed so far."""
    count = [0]
    forward_batch = llm.engine.forward_batch

    def counted(*args: Any) -> Any:
        count[0] += 1
        return forward_batch(*args)

    llm.engine.forward_batch = counted  # type: ignore[method-assign]
    return count


def _assert_good_ones_complete(out: list[dict[str, Any]], ref: list[list[int]]) -> None:
    assert [o["token_ids"] for o in out] == ref
    assert all(o["finish_reason"] == "length" and o["error"] is None for o in out)


def test_a_prompt_longer_than_the_model_takes_gets_an_error_naming_the_lengths(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=2, max_seq_len_override=MAX_SEQ_LEN)
    too_long = list(range(3, 3 + 80))
    at_limit = [5] * MAX_SEQ_LEN  # leaves no room for even one output token
    out = llm.generate([GOOD[0], too_long, GOOD[1], at_limit, GOOD[2]], greedy(8))

    for bad, n in ((out[1], 80), (out[3], MAX_SEQ_LEN)):
        assert bad["finish_reason"] == "error"
        assert bad["token_ids"] == [] and bad["text"] == ""
        assert f"{n} tokens" in bad["error"] and str(MAX_SEQ_LEN - 1) in bad["error"]
    _assert_good_ones_complete([out[0], out[2], out[4]], hf_reference(llama, GOOD[:3], 8))
    assert_nothing_held(llm)


def test_max_tokens_is_cut_to_the_room_the_model_has_left(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=2, max_seq_len_override=MAX_SEQ_LEN)
    [prompt] = random_prompts(1, seed=5, min_len=MAX_SEQ_LEN - 3, max_len=MAX_SEQ_LEN - 3)
    [out] = llm.generate([prompt], greedy(50))
    assert out["token_ids"] == hf_reference(llama, [prompt], 3)[0]
    assert out["finish_reason"] == "length"
    assert_nothing_held(llm)


def test_a_prompt_that_needs_more_kv_than_the_pool_holds_gets_an_error(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=4, num_page_override=40)
    out = llm.generate([GOOD[0], list(range(3, 33)), GOOD[1]], greedy(16))
    assert out[1]["finish_reason"] == "error"
    assert "30 tokens" in out[1]["error"] and "40" in out[1]["error"] and "max_tokens" in out[1]["error"]
    _assert_good_ones_complete([out[0], out[2]], hf_reference(llama, GOOD[:2], 16))
    assert_nothing_held(llm)


INVALID: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    # what no message between the server's processes can carry, and what the sampler cannot compute with
    ("max_tokens", 2**63),
    ("top_k", 2**100),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop_token_ids", [2**63]),
    ("temperature", float("inf")),
    ("top_p", float("nan")),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", float("-inf")),
    # what would make the one detokenizer slow for every request
    ("stop", ["x"] * 33),
    ("stop", ["x" * 257]),
    ("stop_token_ids", list(range(1025))),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_sampling_params_raise_before_anything_is_scheduled(
    name: str, value: Any, llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=3)
    forwards = _count_forwards(llm)
    bad = SamplingParams(max_tokens=4)
    setattr(bad, name, value)
    with pytest.raises(ValueError, match=name):
        llm.generate(GOOD[:3], [greedy(4), bad, greedy(4)])
    assert forwards[0] == 0
    assert_nothing_held(llm)
    # the engine is as good as new: the next call runs only its own requests
    _assert_good_ones_complete(llm.generate(GOOD[2:], greedy(4)), hf_reference(llama, GOOD[2:], 4))
    assert_nothing_held(llm)


def test_a_list_of_sampling_params_must_match_the_prompts(llama: str, make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(llama, max_running_req=3)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(GOOD[:3], [greedy(4), greedy(4)])
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "bad_prompt",
    [[], "", [5, 320], [5, 10**9], [-1, 5]],
    ids=["no ids", "empty text", "vocab size", "huge id", "negative id"],
)
def test_an_empty_or_out_of_vocabulary_prompt_gets_an_error_output(
    bad_prompt: Any, llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=2)
    out = llm.generate([GOOD[0], bad_prompt, GOOD[1], GOOD[2]], greedy(6))
    assert out[1]["finish_reason"] == "error"
    assert out[1]["token_ids"] == [] and out[1]["error"]
    _assert_good_ones_complete([out[0], out[2], out[3]], hf_reference(llama, GOOD[:3], 6))
    assert_nothing_held(llm)


def test_a_call_where_every_prompt_is_bad_still_answers_each(
    llama: str, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=2, max_seq_len_override=MAX_SEQ_LEN)
    out = llm.generate([[], [999], [4] * 100], greedy(4))
    assert [o["finish_reason"] for o in out] == ["error"] * 3
    assert "empty" in out[0]["error"] and "vocabulary" in out[1]["error"] and "100 tokens" in out[2]["error"]
    assert_nothing_held(llm)
