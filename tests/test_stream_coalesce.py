"""A stream writes what has arrived: replies of a choice that queued up while the last chunk was being
written leave as one chunk (one write), and nothing of them is lost."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from minisgl.message.frontend import TokenLogprob, UserReply, merge_replies
from minisgl.server.api_server import ChatFormat, Choice, CompletionFormat, _stream
from minisgl.server.client import RequestGroup
from minisgl.server.coalesce import coalesce


def _token(i: int) -> TokenLogprob:
    return TokenLogprob(i, f"t{i}", -0.1 * i)


def _replies(uid: int, words: list[str], prompt_tokens: int = 3) -> list[UserReply]:
    """A request's replies, one a token, the last one finishing it with 'length'."""
    out = []
    for k, word in enumerate(words):
        last = k == len(words) - 1
        out.append(
            UserReply(
                uid,
                word,
                last,
                "length" if last else None,
                prompt_tokens=prompt_tokens,
                completion_tokens=k + 1,
                logprobs=[_token(k)],
                token_ids=[k],
            )
        )
    out[0].prompt_token_ids, out[0].prompt_text = [7, 8, 9], "the prompt"
    return out


def test_merged_replies_carry_every_token_and_the_latest_counts() -> None:
    a, b, c = _replies(0, ["a", "b", "c"])
    m = merge_replies(merge_replies(a, b), c)
    assert m.text == "abc" and m.token_ids == [0, 1, 2]
    assert [t.token_id for t in m.logprobs or []] == [0, 1, 2]
    assert m.completion_tokens == 3 and m.finished and m.finish_reason == "length"
    # the prompt comes with the first reply only and survives the merge
    assert m.prompt_token_ids == [7, 8, 9] and m.prompt_text == "the prompt"


def test_coalesce_merges_per_choice_in_order_of_first_arrival() -> None:
    r0, r1 = _replies(10, ["x", "y"]), _replies(11, ["p", "q", "r"])
    got = coalesce([(1, r1[0]), (0, r0[0]), (1, r1[1]), (0, r0[1]), (1, r1[2])])
    assert [(i, r.text, r.finished) for i, r in got] == [(1, "pqr", True), (0, "xy", True)]


class _Client:
    def abort(self, uids: list[int]) -> None:
        self.aborted = uids


def _run_stream(fmt: Any, n: int, replies: list[tuple[int, UserReply]]) -> list[str]:
    """The writes of a stream whose replies after the first of each choice were all queued at once."""

    async def main() -> list[str]:
        group = RequestGroup(_Client(), list(range(n)))  # type: ignore[arg-type]
        first = [next((i, r) for i, r in replies if i == c) for c in range(n)]
        for item in replies:
            if item not in first:
                group.put(*item)
        watcher = asyncio.get_running_loop().create_future()
        return [w async for w in _stream(group, watcher, first, [Choice() for _ in range(n)], fmt)]

    return asyncio.run(main())


def _events(writes: list[str]) -> list[Any]:
    events = "".join(writes).removesuffix("data: [DONE]\n\n").split("\n\n")
    return [json.loads(e.removeprefix("data: ")) for e in events if e]


def test_queued_completion_replies_go_out_as_one_write_with_all_their_text() -> None:
    words = [f" w{k}" for k in range(20)]
    fmt = CompletionFormat("m", 1, include_usage=True, logprobs_asked=True)
    writes = _run_stream(fmt, 1, [(0, r) for r in _replies(0, words)])
    assert len(writes) == 2  # the first reply, then the nineteen that waited, usage and [DONE]
    assert writes[-1].endswith("data: [DONE]\n\n")
    events = _events(writes)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == "".join(words) and len(texts) == 2
    # every token's log-probability is there, with text offsets that run on across chunks
    tokens = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events if e["choices"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == [f"t{k}" for k in range(20)] and offsets == [
        sum(len(t) for t in tokens[:k]) for k in range(20)
    ]
    assert events[-1]["usage"]["completion_tokens"] == 20


def test_queued_chat_replies_of_two_choices_each_keep_their_text_and_finish() -> None:
    a, b = _replies(0, ["He", "llo", "!"]), _replies(1, ["Bon", "jour"])
    fmt = ChatFormat("m", 2, include_usage=False)
    events = _events(_run_stream(fmt, 2, [(0, a[0]), (1, b[0]), (0, a[1]), (1, b[1]), (0, a[2])]))
    for i, text in ((0, "Hello!"), (1, "Bonjour")):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == text
        assert mine[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1][
            "finish_reason"
        ] == "length"
