"""Incremental detokenization: the streamed pieces add up to the offline text, never split a UTF-8
character, cut stop strings out, and lose nothing at the end."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tiny import build_tokenizer

from minisgl.message import DetokenizeMsg
from minisgl.tokenizer.detokenize import DetokenizeStep, IncrementalDetokenizer, decode_all, step_batch


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def stream(
    tokenizer: Any, ids: list[int], stop: list[str] | None = None, keep_stop: bool = False
) -> tuple[list[str], str]:
    """(the pieces shown while tokens arrive, what finish() adds at the end)."""
    detok = IncrementalDetokenizer(tokenizer, stop, keep_stop=keep_stop)
    return [detok.add(t) for t in ids], detok.finish()


def offline_text(tokenizer: Any, ids: list[int], stop: list[str] | None = None) -> str:
    """What the offline LLM returns for these output tokens."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop or []) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


TEXTS = ["héllo wörld", "naïve café: 日本語のテキスト", "emoji 🙂🚀 and ∑ math", "plain ascii only"]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_are_never_split(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 4  # bytes outside the tiny vocabulary: characters span tokens
    pieces, tail = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tail == text
    assert tail == ""  # every character was complete by the last token


@pytest.mark.parametrize("seed", range(20))
def test_random_tokens_stream_to_the_offline_text(tokenizer: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) + tail == offline_text(tokenizer, ids)


def test_an_unfinished_character_at_the_end_is_not_lost(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab🙂")[:-1]  # the emoji's last byte never comes
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) == "ab"
    assert tail == tokenizer.decode(ids)[2:] and tail.startswith("\ufffd")


def test_stop_string_is_cut_and_nothing_after_it_is_shown(tokenizer: Any) -> None:
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    detok = IncrementalDetokenizer(tokenizer, ["Paris."])
    shown = ""
    for t in ids:
        shown += detok.add(t)
        if detok.stopped:
            break
    shown += detok.finish()
    assert shown == "The capital of France is "
    assert detok.stopped


def test_a_kept_stop_string_ends_the_text_and_a_kept_stop_token_is_output(tokenizer: Any) -> None:
    """vLLM's include_stop_str_in_output (SGLang's no_stop_trim): the text runs to the stop string's end, nothing after;
    a stop token the scheduler ended the output with is an output token whose text is shown."""
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    detok = IncrementalDetokenizer(tokenizer, ["Paris."], keep_stop=True)
    shown = ""
    for t in ids:
        shown += detok.add(t)
        if detok.stopped:
            break
    assert shown + detok.finish() == "The capital of France is Paris." and detok.matched == "Paris."
    # the same, streamed over every split of the string by tokens
    for seed in range(5):
        rng = random.Random(seed)
        cut = [rng.randrange(len(tokenizer)) for _ in range(6)] + ids
        full = tokenizer.decode(cut)
        pieces, tail = stream(tokenizer, cut, ["is", "Rome"], keep_stop=True)
        first = min(full.find(s) + len(s) for s in ("is", "Rome") if full.find(s) >= 0)
        assert "".join(pieces) + tail == full[:first]
    stop_token = tokenizer.encode("Paris")[0]
    detok = IncrementalDetokenizer(tokenizer, keep_stop=True)
    head = tokenizer.encode("The capital of France is")
    steps = [detok.step(DetokenizeMsg(0, t, False)) for t in head]
    last = detok.step(DetokenizeMsg(0, stop_token, True, "stop"))
    assert last.output_token == stop_token
    assert "".join(x.text for x in steps) + last.text == tokenizer.decode([*head, stop_token])
    assert tokenizer.decode([stop_token]).strip()  # the stop token has text to show
    plain = IncrementalDetokenizer(tokenizer)
    for t in head:
        plain.step(DetokenizeMsg(0, t, False))
    assert plain.step(DetokenizeMsg(0, stop_token, True, "stop")).output_token is None


def test_text_that_may_start_a_stop_string_is_held_until_known(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three")
    detok = IncrementalDetokenizer(tokenizer, ["two!", "thr"])
    shown = [detok.add(t) for t in ids]
    # "two" could have been the start of "two!": it is shown only once the next text rules that out
    assert "".join(shown) + detok.finish() == "one two "
    assert all(not p.endswith("tw") for p in shown)


@pytest.mark.parametrize("seed", range(20))
def test_random_stop_strings_match_the_offline_cut(tokenizer: Any, seed: int) -> None:
    rng = random.Random(100 + seed)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(40)]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    start = rng.randrange(len(text) - 3)
    stop = [text[start : start + rng.randint(1, 3)], "never appears \x00"]
    pieces, tail = stream(tokenizer, ids, stop)
    assert "".join(pieces) + tail == offline_text(tokenizer, ids, stop)


def test_a_partial_stop_string_at_the_end_is_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello wor")
    pieces, tail = stream(tokenizer, ids, ["world"])
    assert "".join(pieces) == "hello "
    assert tail == "wor"


def _msgs_of(uid: int, ids: list[int], reason: str) -> list[DetokenizeMsg]:
    """The scheduler's messages for a request whose last token ends it with `reason`."""
    return [
        DetokenizeMsg(uid, t, k == len(ids) - 1, reason if k == len(ids) - 1 else None)
        for k, t in enumerate(ids)
    ]


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_a_batched_step_gives_each_request_what_its_own_steps_give(
    tokenizer: Any, seed: int, mixed: bool
) -> None:
    """Requests of different lengths, stop strings, special tokens and unfinished characters, stepped
    together (one decode call a step, the ending ones' last windows in one more) and one at a time, show the
    same pieces and end the same way; `mixed`: every other request not streaming (the offline detokenizer,
    which decodes its whole output when it ends unless it has stop strings)."""
    rng = random.Random(500 + seed)
    streams = []
    for uid in range(12):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        ids[rng.randrange(len(ids)) :] = tokenizer.encode("é🙂 stop here")[: rng.randint(0, 6)] or ids[-1:]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop = [text[len(text) // 2 : len(text) // 2 + 2]] if uid % 3 == 0 and len(text) > 4 else None
        streams.append((stop, _msgs_of(uid, ids, rng.choice(["length", "stop"]))))
    streaming = [not (mixed and uid % 2) for uid in range(len(streams))]
    alone = [
        IncrementalDetokenizer(tokenizer, stop, streaming=on) for (stop, _), on in zip(streams, streaming)
    ]
    together = [
        IncrementalDetokenizer(tokenizer, stop, streaming=on) for (stop, _), on in zip(streams, streaming)
    ]
    assert not mixed or any(d.lazy for d in together)
    expected = [[d.step(m) for m in msgs if not d.stopped] for d, (_, msgs) in zip(alone, streams)]
    got: list[list[DetokenizeStep]] = [[] for _ in streams]
    for k in range(max(len(msgs) for _, msgs in streams)):
        step = [
            (i, msgs[k]) for i, (_, msgs) in enumerate(streams) if k < len(msgs) and not together[i].stopped
        ]
        for (i, _), result in zip(step, step_batch(tokenizer, [(together[i], m) for i, m in step])):
            got[i].append(result)
    assert got == expected
    assert any(d.stopped for d in together)  # the stop strings were met, not only looked for


def test_decode_all_is_the_tokenizers_own_decode(tokenizer: Any) -> None:
    rng = random.Random(7)
    seqs = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 9))] for _ in range(50)]
    assert decode_all(tokenizer, seqs) == [tokenizer.decode(s, skip_special_tokens=True) for s in seqs]


def test_a_step_decodes_each_request_with_or_without_its_control_tokens(tokenizer: Any) -> None:
    """step_batch decodes the requests that keep control tokens apart from the rest, each as decode would."""
    rng = random.Random(3)
    specials = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    seqs = [[rng.choice([*specials, *range(3, 200)]) for _ in range(12)] for _ in range(6)]
    for s in seqs:  # one of each at least, among the text
        s[rng.randrange(6)], s[6 + rng.randrange(6)] = specials
    dets = [IncrementalDetokenizer(tokenizer, skip_special_tokens=k % 2 == 0) for k in range(len(seqs))]
    texts = [""] * len(seqs)
    for t in range(12):
        results = step_batch(
            tokenizer, [(d, DetokenizeMsg(k, seqs[k][t], False)) for k, d in enumerate(dets)]
        )
        texts = [text + r.text for text, r in zip(texts, results)]
    texts = [text + d.finish() for text, d in zip(texts, dets)]
    want = [tokenizer.decode(s, skip_special_tokens=k % 2 == 0) for k, s in enumerate(seqs)]
    assert texts == want
    assert any("<|im_start|>" in w for w in want[1::2])  # the kept ones have some to keep


@pytest.mark.parametrize("seed", range(5))
def test_taking_plain_tokens_apart_ends_as_stepping_them(tokenizer: Any, seed: int) -> None:
    """The offline LLM hands a lazy detokenizer its plain tokens through take_plain and the rest through step():
    the text and ids at the end are what step() alone gives; a streaming or stop-string detokenizer, a finishing
    message and a message without a token are refused."""
    rng = random.Random(900 + seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(2, 40))] + tokenizer.encode("é🙂")[:3]
    msgs = _msgs_of(0, ids, rng.choice(["length", "stop"]))
    stepped = IncrementalDetokenizer(tokenizer, streaming=False)
    for m in msgs:
        stepped.step(m)
    taken = IncrementalDetokenizer(tokenizer, streaming=False)
    plain = [taken.take_plain(m) for m in msgs]
    assert plain == [not m.finished for m in msgs]  # the plain ones taken, the last (finishing) one refused
    assert not taken.step(msgs[-1]).abort
    assert (taken.ids, taken.text) == (stepped.ids, stepped.text)
    assert not taken.take_plain(DetokenizeMsg(0, -1, False))
    assert not IncrementalDetokenizer(tokenizer, streaming=True).take_plain(msgs[0])
    assert not IncrementalDetokenizer(tokenizer, ["x"], streaming=False).take_plain(msgs[0])
