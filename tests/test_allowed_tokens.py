"""vLLM's allowed_token_ids: a request samples only among the token ids it names, each step, greedy or sampled, with
or without a grammar; checked against transformers' logits restricted to the same ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, random_prompts

from minisgl.core import RequestError, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

PROMPTS = random_prompts(3, seed=21, min_len=4, max_len=12)
ALLOWED = [5, 9, 17, 40, 101]


@pytest.fixture(autouse=True)
def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)


def restricted_greedy(folder: str, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with every token but `allowed` masked out of the logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = allowed[int(logits[allowed].argmax())]
            out.append(token)
            ids.append(token)
    return out


def test_greedy_tokens_are_the_best_allowed_ones(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    llm = make_llm(path, cache_type="naive")
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    out = llm.generate(
        PROMPTS, [free, SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=ALLOWED), free]
    )
    assert out[1]["token_ids"] == restricted_greedy(path, PROMPTS[1], ALLOWED, 6)
    # the rows beside it sample from the whole vocabulary, as without it
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], free)
    assert [out[0]["token_ids"], out[2]["token_ids"]] == [o["token_ids"] for o in alone]
    assert not set(out[0]["token_ids"]) <= set(ALLOWED)
    # sampled at temperature 1: every token among them, the first one (a prefill's) too
    sampled = llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=ALLOWED)
    )
    assert all(set(o["token_ids"]) <= set(ALLOWED) and len(o["token_ids"]) == 12 for o in sampled)
    assert_nothing_held(llm)


def test_with_a_grammar_only_tokens_both_allow_are_sampled(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    pytest.importorskip("xgrammar")
    llm = make_llm(tiny_model("llama"), cache_type="naive")
    a = llm.tokenizer.convert_tokens_to_ids("a")
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(max_tokens=8, regex="(a|b)+", allowed_token_ids=[a, eos, 7])
    out = llm.generate(PROMPTS[:1], params)[0]
    assert set(out["token_ids"]) <= {a, eos} and out["text"] == "a" * len(out["text"]) and out["text"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([], "1 to"),
        ([-1], "integers >= 0"),
        ([3, True], "integers >= 0"),
        ("5", "list"),
        ([1 << 40], "vocabulary"),
    ],
)
def test_bad_allowed_token_ids_are_refused(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], value: Any, words: str
) -> None:
    llm = make_llm(tiny_model("llama"), cache_type="naive")
    params = SamplingParams(max_tokens=2, allowed_token_ids=value)
    if words == "vocabulary":  # in range as a value, outside this model: the request's error, the others run
        out = llm.generate([PROMPTS[0]], params)[0]
        assert out["finish_reason"] == "error" and "allowed_token_ids" in out["error"]
        return
    with pytest.raises(RequestError, match=words):
        llm.generate([PROMPTS[0]], params)
