"""vLLM's bad_words: a request's output never contains the words it names (as written alone or after a space);
greedy tokens checked against transformers' logits with the same sequences banned step by step, in the plain and
the overlap loop, beside requests without bans."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, overlap_loop_llm, random_prompts

from minisgl.constrained.bad_words import BadWords
from minisgl.constrained.bits import token_bits
from minisgl.constrained.grammar import GrammarManager
from minisgl.core import RequestError, SamplingParams, set_global_ctx
from minisgl.env import ENV
from minisgl.llm import LLM

PROMPTS = random_prompts(3, seed=21, min_len=4, max_len=12)
N = 12


@pytest.fixture(autouse=True)
def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)


def sequences(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences vLLM bans for `words`: each word's text, and the text after a space."""
    out = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids not in out:
                out.append(ids)
    return out


def banned_greedy(folder: str, prompt: list[int], banned: list[list[int]], n: int) -> list[int]:
    """transformers' greedy tokens with, at each step, the last token of every banned sequence whose other
    tokens end the output so far masked out of the logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            for seq in banned:
                head = seq[:-1]
                if len(out) >= len(head) and out[len(out) - len(head) :] == head:
                    logits[seq[-1]] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def words_of(tokenizer: Any, free: list[list[int]]) -> list[str]:
    """Two words the free outputs contain: a token that decodes to a space and a word, and a pair of tokens
    that make a word as written; each taken where the tokenizer gives the same tokens back for its text."""

    def clean(ids: list[int]) -> bool:
        return tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids

    spaced = next(t for out in free for t in out if clean([t]) and tokenizer.decode([t]).startswith(" "))
    pair = next(
        out[i : i + 2]
        for out in free
        for i in range(len(out) - 1)
        if clean(out[i : i + 2])
        and not tokenizer.decode(out[i : i + 2]).startswith(" ")
        and len(tokenizer.decode(out[i : i + 2]).strip()) > 1
    )
    return [tokenizer.decode([spaced]).strip(), tokenizer.decode(pair)]


@pytest.fixture
def overlap_llm(tiny_model: Callable[[str], str]) -> Iterator[Callable[..., LLM]]:
    built: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        built.append(overlap_loop_llm(tiny_model("llama"), dtype=torch.float32, cache_type="naive", **kwargs))
        return built[-1]

    yield make
    for llm in built:
        llm.shutdown()


def test_greedy_tokens_are_transformers_with_the_words_banned(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], overlap_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    llm = make_llm(path, cache_type="naive")
    free = SamplingParams(max_tokens=N, ignore_eos=True)
    plain = [o["token_ids"] for o in llm.generate(PROMPTS, free)]
    words = words_of(llm.tokenizer, plain)
    banned = sequences(llm.tokenizer, words)
    assert any(len(s) == 1 for s in banned) and any(len(s) > 1 for s in banned)
    params = SamplingParams(max_tokens=N, ignore_eos=True, bad_words=words)
    out = llm.generate(PROMPTS, [params, free, params])
    # the rows beside them sample from the whole vocabulary, as without them
    assert out[1]["token_ids"] == plain[1]
    for i in (0, 2):
        tokens = out[i]["token_ids"]
        assert tokens == banned_greedy(path, PROMPTS[i], banned, N)
        assert not any(contains(tokens, s) for s in banned)
    # the bans bite: at least one row's free output held a banned sequence
    assert any(contains(plain[i], s) for i in (0, 2) for s in banned)
    assert not llm.grammars.active  # the bans went with their requests
    assert_nothing_held(llm)
    # the overlap loop fills a step's bans after the last step's tokens are in: the same tokens
    overlapped = overlap_llm().generate(PROMPTS, [params, free, params])
    assert [o["token_ids"] for o in overlapped] == [o["token_ids"] for o in out]
    set_global_ctx(llm.engine.ctx)


def test_sampled_outputs_never_hold_a_banned_word(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), cache_type="naive")
    tok = llm.tokenizer
    hot = SamplingParams(max_tokens=24, temperature=1.5, seed=4, ignore_eos=True)
    free = [o["token_ids"] for o in llm.generate(PROMPTS * 4, hot)]
    # the most frequent clean single tokens of the free outputs, and their texts as words
    counts: dict[int, int] = {}
    for out in free:
        for t in out:
            counts[t] = counts.get(t, 0) + 1
    common = [
        t
        for t in sorted(counts, key=lambda t: -counts[t])
        if tok.decode([t]).strip() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]
    ][:6]
    words = [tok.decode([t]) for t in common]
    banned = sequences(tok, words)
    outs = llm.generate(
        PROMPTS * 4, SamplingParams(max_tokens=24, temperature=1.5, seed=4, ignore_eos=True, bad_words=words)
    )
    assert all(len(o["token_ids"]) == 24 for o in outs)
    assert not any(contains(o["token_ids"], s) for o in outs for s in banned)
    assert any(t in common for out in free for t in out)


def test_with_allowed_token_ids_the_bans_narrow_them(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), cache_type="naive")
    tok = llm.tokenizer
    a, b = tok.encode("a", add_special_tokens=False)[0], tok.encode("b", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, allowed_token_ids=[a, b], bad_words=["a"])
    out = llm.generate(PROMPTS[:1], params)[0]
    assert out["token_ids"] == [b] * 8
    # every allowed token banned: nothing could be sampled, so the request is refused naming bad_words
    refused = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, allowed_token_ids=[a], bad_words=["a"]))[
        0
    ]
    assert refused["finish_reason"] == "error" and "bad_words" in refused["error"]
    assert_nothing_held(llm)


def test_a_step_whose_bans_leave_nothing_keeps_the_narrowed_row() -> None:
    """With a grammar or allowed_token_ids a step's bans may cover every token left: that row stays as it was,
    and a row of the whole vocabulary loses only its bans."""
    grammars = GrammarManager(None, 64, [0])
    grammars.allowed[1] = token_bits([7], 64)
    grammars.allowed[2] = token_bits([7, 9], 64)
    for uid in (1, 2, 3):
        grammars.bad_words[uid] = BadWords([[5, 7], [9]], 64)
    # each request's output so far ends with 5 (its prompt is the first two tokens): 7 and 9 are banned
    reqs = [SimpleNamespace(uid=uid, input_ids=[1, 2, 5], prompt_len=2) for uid in (1, 2, 3)]
    mask = grammars.fill_masks(reqs)
    assert mask is not None
    assert mask[0].tolist() == token_bits([7], 64).tolist()
    assert mask[1].tolist() == token_bits([7, 9], 64).tolist()
    assert mask[2].tolist() == token_bits([t for t in range(64) if t not in (7, 9)], 64).tolist()
    # a prompt ending with 5 bans nothing: only the output is looked at
    mask = grammars.fill_masks([SimpleNamespace(uid=3, input_ids=[1, 5], prompt_len=2)])
    assert mask is not None and mask[0].tolist() == token_bits([t for t in range(64) if t != 9], 64).tolist()
    # bit 31 of a word (an int32's sign) clears like the others
    high = BadWords([[3, 31], [3, 63]], 64)
    row = token_bits([31, 63, 30], 64)
    high.apply(row, [3], 0)
    assert row.tolist() == token_bits([30], 64).tolist()
    grammars.close()


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([""], "1 to"),
        (["   "], "spaces"),
        ([3], "characters"),
        (["x"] * 129, "at most 128"),
        (["y" * 257], "characters"),
    ],
)
def test_bad_words_out_of_range_are_refused(value: Any, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        SamplingParams(bad_words=value).validate()
    # one string is one word, as stop takes it
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
