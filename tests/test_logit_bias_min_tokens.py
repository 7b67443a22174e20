"""logit_bias and min_tokens, through the offline engine on a tiny model (greedy, so every effect is exact)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import Reference
from tiny import assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.message import DetokenizeMsg
from minisgl.tokenizer.detokenize import IncrementalDetokenizer

PROMPTS = random_prompts(4, seed=5, min_len=3, max_len=20)


@pytest.fixture
def llm(tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(tiny_model("llama"), max_running_req=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bias_of_100_forces_its_token_only_in_its_own_request(
    llm: LLM, hf_reference: Reference, temperature: float
) -> None:
    ref = hf_reference(llm.engine.model_dir, PROMPTS, 6)
    forced = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logit_bias={42: 100.0})
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    out = llm.generate(PROMPTS, [forced, plain, forced, plain])
    assert out[0]["token_ids"] == out[2]["token_ids"] == [42] * 6
    assert [out[1]["token_ids"], out[3]["token_ids"]] == [ref[1], ref[3]]
    assert_nothing_held(llm)


def test_a_bias_of_minus_100_takes_the_greedy_token_away(llm: LLM, hf_reference: Reference) -> None:
    first = hf_reference(llm.engine.model_dir, PROMPTS[:1], 1)[0][0]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logit_bias={first: -100.0}))
    assert out[0]["token_ids"] != [first]


def test_min_tokens_holds_back_eos_until_reached(llm: LLM) -> None:
    eos = min(llm.eos_token_ids)
    # EOS is made the greedy token at every step: without min_tokens the output ends at once
    wants_eos = dict(max_tokens=10, logit_bias={eos: 100.0})
    out = llm.generate(PROMPTS[:2], [SamplingParams(**wants_eos), SamplingParams(**wants_eos, min_tokens=4)])
    assert out[0]["token_ids"] == [] and out[0]["finish_reason"] == "stop"
    assert len(out[1]["token_ids"]) == 4 and eos not in out[1]["token_ids"]
    assert out[1]["finish_reason"] == "stop"
    assert_nothing_held(llm)


def test_min_tokens_holds_back_stop_token_ids_too(llm: LLM, hf_reference: Reference) -> None:
    ref = hf_reference(llm.engine.model_dir, PROMPTS[:1], 3)[0]
    stop = ref[0]  # the first greedy token is a stop id: the request would end before any output
    out = llm.generate(
        PROMPTS[:1] * 2,
        [
            SamplingParams(max_tokens=8, stop_token_ids=[stop]),
            SamplingParams(max_tokens=8, stop_token_ids=[stop], min_tokens=2, ignore_eos=True),
        ],
    )
    assert out[0]["token_ids"] == []
    assert len(out[1]["token_ids"]) >= 2 and stop not in out[1]["token_ids"][:2]


def test_min_tokens_and_logit_bias_are_checked(llm: LLM) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, min_tokens=3))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={1: 101.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["hi"], SamplingParams(logit_bias={-1: 1.0}))
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))
    assert out[0]["finish_reason"] == "error" and "vocabulary" in out[0]["error"]
    assert_nothing_held(llm)


class _CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _run(detok: IncrementalDetokenizer, text: str) -> tuple[str, bool]:
    out = ""
    for ch in text:
        step = detok.step(DetokenizeMsg(0, ord(ch), False))
        out += step.text
        if step.finished:
            return out, True
    return out, False


def test_stop_strings_are_not_looked_for_before_min_tokens() -> None:
    assert _run(IncrementalDetokenizer(_CharTokenizer(), ["ab"]), "xabyabz") == ("x", True)
    # the first "ab" ends at the 3rd token, before min_tokens=4: only the second one stops the output
    assert _run(IncrementalDetokenizer(_CharTokenizer(), ["ab"], min_tokens=4), "xabyabz") == ("xaby", True)
    # a stop string that starts before min_tokens is not cut back out of text already sent
    assert _run(IncrementalDetokenizer(_CharTokenizer(), ["ab"], min_tokens=4), "xxabz") == ("xxabz", False)
