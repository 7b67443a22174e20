"""Prompt logprobs come from the prefill's logits at every prompt position: they equal transformers' log_softmax
whether the prompt is prefilled whole or in chunks, and whether or not its prefix is in the cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny import assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.llm import LLM

PROMPTS = random_prompts(3, seed=7, min_len=12, max_len=30)


def _reference(folder: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("max_extend_tokens", [7, 4096], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_transformers_past_chunks_and_the_prefix_cache(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], max_extend_tokens: int
) -> None:
    folder = tiny_model("llama")
    llm = make_llm(folder, max_running_req=4, max_extend_tokens=max_extend_tokens)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2))  # every prompt is in the prefix cache now
    asked = SamplingParams(max_tokens=2, prompt_logprobs=3)
    out = llm.generate(PROMPTS, [asked, SamplingParams(max_tokens=2), asked])
    assert out[1]["prompt_logprobs"] is None and out[1]["cached_tokens"] > 0
    for o, ids in zip([out[0], out[2]], [PROMPTS[0], PROMPTS[2]]):
        want = _reference(folder, ids)
        entries = o["prompt_logprobs"]
        assert o["cached_tokens"] == 0 and len(entries) == len(ids) and entries[0] is None
        for p in range(1, len(ids)):
            assert entries[p][ids[p]] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4)
            top = want[p - 1].topk(3)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                assert entries[p][token] == pytest.approx(value, abs=1e-4)
    assert_nothing_held(llm)


def test_a_one_token_prompt_has_one_empty_entry(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=2)
    out = llm.generate([[17]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out[0]["prompt_logprobs"] == [None] and len(out[0]["token_ids"]) <= 1


def test_offline_output_logprobs_equal_transformers_for_each_generated_token(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    folder = tiny_model("llama")
    llm = make_llm(folder, max_running_req=4)
    asked = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2)
    out = llm.generate(PROMPTS, [asked, SamplingParams(max_tokens=3), asked])
    assert out[1]["logprobs"] is None  # not asked
    for o, ids in zip(out, PROMPTS):
        if o["logprobs"] is None:
            continue
        new = o["token_ids"]
        assert len(o["logprobs"]) == len(new) == 5
        want = _reference(folder, ids + new)
        for i, (token, entry) in enumerate(zip(new, o["logprobs"])):
            row = want[len(ids) - 1 + i]
            assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
            top = row.topk(2)
            for value, t in zip(top.values.tolist(), top.indices.tolist()):
                assert entry[t] == pytest.approx(value, abs=1e-4)
    assert_nothing_held(llm)
