"""A thinking model's reasoning apart from its answer (`--reasoning-parser`): the parser on its own, fed in
pieces of every size, and a real server whose tiny model is made to write a `<think>` block (a regex
constraint spells it), read through the openai client, streamed and whole."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_server import SERVER_ARGS, Server

from minisgl.tokenizer.reasoning import (
    ReasoningCount,
    ReasoningParser,
    prompt_opens,
    reasoning_format,
    tag_ids,
)

QWEN3 = reasoning_format("qwen3")
R1 = reasoning_format("deepseek_r1")  # vLLM's spelling of SGLang's deepseek-r1


def split(text: str, fmt=QWEN3, prompt_open: bool = False, piece: int = 1, stream: bool = True):
    """(reasoning, content, how many pieces of reasoning came out) of `text` fed `piece` characters a call."""
    parser = ReasoningParser(fmt, prompt_open, stream)
    reasoning = content = ""
    given = 0
    for at in range(0, len(text), piece):
        r, c = parser.feed(text[at : at + piece])
        reasoning, content, given = reasoning + r, content + c, given + bool(r)
    r, c = parser.finish()
    return reasoning + r, content + c, given + bool(r)


THOUGHT = "<think>\nFirst 2, then 2 more.\n\nSo 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 1000])
def test_the_split_is_the_same_whatever_pieces_the_text_comes_in(piece: int) -> None:
    reasoning, content, _ = split(THOUGHT, piece=piece)
    assert (reasoning, content) == ("First 2, then 2 more.\n\nSo 4.", "The answer is 4.")


def test_where_the_reasoning_starts() -> None:
    # no block: all answer, as written
    assert split("\n\nJust the answer.")[:2] == ("", "\n\nJust the answer.")
    # a prompt that ends inside <think> (a thinking template, or an assistant message continued)
    assert split("more thought</think>answer", prompt_open=True)[:2] == ("more thought", "answer")
    # ... and a model that writes the tag again anyway
    assert split("<think>x</think>y", prompt_open=True)[:2] == ("x", "y")
    # DeepSeek-R1 thinks from the start whatever the prompt says
    assert prompt_opens(R1, "<|im_start|>assistant\n")
    assert split("thought</think>answer", fmt=R1, prompt_open=True)[:2] == ("thought", "answer")
    # a Qwen3 prompt that closed the block itself (enable_thinking false) leaves the output all answer
    assert not prompt_opens(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_opens(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens(QWEN3, "<|im_start|>assistant\n")


def test_an_output_cut_inside_the_reasoning_is_all_reasoning() -> None:
    for piece in (1, 4, 100):
        assert split("<think>\nstill thinking</thi", piece=piece)[:2] == ("still thinking</thi", "")
    # a tag begun but never finished is text
    assert split("<thin")[:2] == ("", "<thin")
    assert split("<think>")[:2] == ("", "")


def test_text_like_a_tag_is_not_one() -> None:
    assert split("<think>a </th b</think> c")[:2] == ("a </th b", "c")
    assert split("answer with <think> inside")[:2] == ("", "answer with <think> inside")


def test_whitespace_is_held_until_text_follows_it() -> None:
    parser = ReasoningParser(QWEN3, False)
    assert parser.feed("<think>\n") == ("", "")
    assert parser.feed("a \n") == ("a", "")
    assert parser.feed("b") == (" \nb", "")
    assert parser.feed("\n</think>\n\n") == ("", "")
    assert parser.feed(" ok") == ("", "ok")


def test_reasoning_not_streamed_comes_whole_when_it_ends() -> None:
    reasoning, content, given = split(THOUGHT, stream=False)
    assert (reasoning, content, given) == ("First 2, then 2 more.\n\nSo 4.", "The answer is 4.", 1)
    assert split("<think>abc def", stream=False)[::2] == ("abc def", 1)
    assert split(THOUGHT)[2] > 5


# ---- a real server --------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hello world"}]
# what the constraint makes the tiny model write: a block, then the answer
FORCED = r"<think>\nI add 2 and 2\.\n</think>\n\nIt is 4\."


def reasoning_server(tiny_model: Callable[[str], str]) -> Iterator[Server]:
    """A server with --reasoning-parser qwen3 on a tiny model whose vocabulary has <think> and </think> as
    tokens, as Qwen3's has (the reasoning's tokens are counted): this module's, and test_responses.py's."""
    s = Server(["--model", tiny_model("llama-think"), *SERVER_ARGS, "--reasoning-parser", "qwen3"])
    s.name = s.client().models.list().data[0].id
    yield s
    s.stop()


server = pytest.fixture(reasoning_server, scope="module", name="server")


def chat(server: Server, **extra: Any) -> Any:
    body = {"regex": FORCED, **extra.pop("extra_body", {})}
    messages = extra.pop("messages", CHAT)
    extra = {"max_tokens": 80, "temperature": 0, **extra}
    return server.client().chat.completions.create(
        model=server.name, messages=messages, extra_body=body, **extra
    )


def stream_parts(server: Server, **extra: Any) -> tuple[list[str], str]:
    """The reasoning deltas of a stream and its content joined."""
    reasoning, content = [], ""
    for chunk in chat(server, stream=True, **extra):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            reasoning.append(piece)
        content += delta.content or ""
    return reasoning, content


def count(tokens: list[int], opened: bool = False) -> int:
    counter = ReasoningCount((1, 2), opened)  # 1 opens, 2 closes
    for t in tokens:
        counter.add(t)
    return counter.tokens


def test_the_reasoning_tokens_are_those_between_the_tags() -> None:
    assert count([1, 5, 6, 7, 2, 8, 9]) == 3  # the tags are not counted, nor the answer
    assert count([5, 6, 2, 8], opened=True) == 2  # the prompt opened the block
    assert count([5, 6, 2, 8]) == 0  # not opened: all answer
    assert count([5, 1, 6, 2]) == 0  # a tag after the answer has started is text of the answer
    assert count([1, 5, 6]) == 2  # cut off inside: all reasoning
    assert count([1, 5, 2, 1, 6, 2]) == 1  # one block, as the parser takes it


def test_tags_are_counted_only_where_they_are_tokens(tiny_model: Callable[[str], str]) -> None:
    from transformers import AutoTokenizer

    with_tags = AutoTokenizer.from_pretrained(tiny_model("llama-think"))
    ids = tag_ids(with_tags, QWEN3)
    assert ids is not None and with_tags.convert_ids_to_tokens(list(ids)) == ["<think>", "</think>"]
    # <think> spelled in several pieces: no count (the answer's usage has no completion_tokens_details)
    assert tag_ids(AutoTokenizer.from_pretrained(tiny_model("llama")), QWEN3) is None


def test_the_usage_counts_the_reasoning_tokens(server: Server, tiny_model: Callable[[str], str]) -> None:
    from transformers import AutoTokenizer

    tags = tag_ids(AutoTokenizer.from_pretrained(tiny_model("llama-think")), QWEN3)
    assert tags is not None
    # the tags as tokens of their own wherever the regex allows them, not spelled in pieces
    bias = {"logit_bias": {str(t): 100 for t in tags}, "return_token_ids": True}

    def between_tags(ids: list[int]) -> int:
        assert ids.count(tags[0]) == ids.count(tags[1]) == 1
        return ids.index(tags[1]) - ids.index(tags[0]) - 1

    reply = chat(server, n=2, temperature=1.0, extra_body=bias)
    expected = [between_tags(c.token_ids) for c in reply.choices]  # type: ignore[attr-defined]
    assert [c.message.reasoning_content for c in reply.choices] == ["I add 2 and 2."] * 2
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == sum(expected) > 0
    # streamed (greedy, as the whole answer it is compared with): the last chunk's usage, and each chunk's own
    # with continuous_usage_stats
    whole = chat(server, extra_body=bias)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(chat(server, stream=True, stream_options=options, extra_body=bias))
    counts = [c.usage.completion_tokens_details.reasoning_tokens for c in chunks if c.usage and c.choices]
    n = between_tags(whole.choices[0].token_ids)  # type: ignore[attr-defined]
    assert counts == sorted(counts) and counts[-1] == n
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == n
    # a completion (no reasoning parser there) has no such field
    done = server.client().completions.create(model=server.name, prompt="a", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens_details is None


def test_the_answer_and_its_reasoning_in_their_fields(server: Server) -> None:
    message = chat(server).choices[0].message
    assert message.content == "It is 4."
    # SGLang's name, and vLLM's newer one
    assert message.reasoning_content == message.reasoning == "I add 2 and 2."
    pieces, content = stream_parts(server)
    # (how many pieces depends on how the stream's writes coalesce: the parser's tests count them)
    assert "".join(pieces) == "I add 2 and 2."
    assert content == "It is 4."
    newer = "".join(
        getattr(c.choices[0].delta, "reasoning", None) or "" for c in chat(server, stream=True) if c.choices
    )
    assert newer == "I add 2 and 2."


def test_every_choice_is_split_on_its_own(server: Server) -> None:
    choices = chat(server, n=3, temperature=1.0).choices
    assert [(c.message.reasoning_content, c.message.content) for c in choices] == [
        ("I add 2 and 2.", "It is 4.")
    ] * 3
    parts: dict[int, list[str]] = {0: ["", ""], 1: ["", ""], 2: ["", ""]}
    for chunk in chat(server, n=3, temperature=1.0, stream=True):
        for c in chunk.choices:
            parts[c.index][0] += getattr(c.delta, "reasoning_content", None) or ""
            parts[c.index][1] += c.delta.content or ""
    assert list(parts.values()) == [["I add 2 and 2.", "It is 4."]] * 3


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece(server: Server) -> None:
    pieces, content = stream_parts(server, extra_body={"stream_reasoning": False})
    assert pieces == ["I add 2 and 2."] and content == "It is 4."


def test_separate_reasoning_false_leaves_the_text_as_written(server: Server) -> None:
    message = chat(server, extra_body={"separate_reasoning": False}).choices[0].message
    assert message.content == "<think>\nI add 2 and 2.\n</think>\n\nIt is 4."
    assert getattr(message, "reasoning_content", None) is None
    assert stream_parts(server, extra_body={"separate_reasoning": False}) == ([], message.content)
    status, got = server.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(
            {"messages": CHAT, "stream": True, "separate_reasoning": False, "stream_reasoning": False}
        ).encode(),
    )
    assert status == 400 and got["error"]["param"] == "stream_reasoning"


def test_a_prompt_left_inside_the_block_makes_the_output_reasoning_first(server: Server) -> None:
    # the assistant's message continued from inside its <think>: what comes out is reasoning until </think>
    # (the tiny model never writes it, so here all of it: the greedy text as written, taken apart)
    messages = [*CHAT, {"role": "assistant", "content": "<think>\nLet me see."}]
    inside = {"continue_final_message": True, "add_generation_prompt": False, "regex": None}
    written = chat(
        server, messages=messages, max_tokens=12, extra_body={**inside, "separate_reasoning": False}
    )
    text = written.choices[0].message.content
    assert text.strip() and "</think>" not in text
    message = chat(server, messages=messages, max_tokens=12, extra_body=inside).choices[0].message
    assert (message.reasoning_content, message.content) == (text.strip(), "")
    pieces, content = stream_parts(server, messages=messages, max_tokens=12, extra_body=inside)
    assert ("".join(pieces), content) == (text.strip(), "")


def test_a_grammar_holds_the_output_as_the_answer_from_its_first_token(server: Server) -> None:
    # the same prompt, the output constrained: it is the answer, tags and all (vLLM waits for the reasoning's
    # end before it applies a grammar; here it holds from the first token)
    messages = [*CHAT, {"role": "assistant", "content": "<think>\nLet me see."}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "regex": r" Two\.</think>Four\."}
    message = chat(server, messages=messages, extra_body=extra).choices[0].message
    assert (message.reasoning_content, message.content) == (None, " Two.</think>Four.")


def test_thinking_switched_off_by_the_template_is_all_answer(server: Server) -> None:
    body = {"chat_template_kwargs": {"enable_thinking": False}, "regex": "Four\\."}
    message = chat(server, extra_body=body).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Four.")


def test_a_tag_a_client_wrote_earlier_does_not_open_the_reasoning(server: Server) -> None:
    # only the model's own turn, as the template opens it, says where the output starts
    messages = [{"role": "user", "content": "What does <think> mean?"}]
    message = chat(server, messages=messages, extra_body={"regex": "Four\\."}).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Four.")


def test_an_answer_sent_back_with_its_reasoning_is_taken(server: Server) -> None:
    first = chat(server).choices[0].message
    history = [*CHAT, first.model_dump(exclude={"tool_calls"}), {"role": "user", "content": "and?"}]
    assert history[1]["reasoning_content"] == history[1]["reasoning"] == "I add 2 and 2."
    again = chat(server, messages=history).choices[0].message
    assert again.content == "It is 4."
    # under vLLM's name alone too; two that differ are refused
    alone = {k: v for k, v in history[1].items() if k != "reasoning_content"}
    assert chat(server, messages=[*CHAT, alone, history[2]]).choices[0].message.content == "It is 4."
    differ = {**history[1], "reasoning": "something else"}
    body = {"messages": [*CHAT, differ, history[2]]}
    status, got = server.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and got["error"]["param"] == "messages[1].reasoning", got


def literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + ch if ch in "\\.^$*+?()[]{}|" else ch for ch in text)


def test_tool_calls_are_read_from_the_answer_not_the_reasoning(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    # a call spelled inside the reasoning is thought, not a call
    extra = {
        "tools": [tool],
        "max_tokens": 300,
        "extra_body": {"regex": literal(f"<think>{call}</think>{call}")},
    }
    choice = chat(server, **extra).choices[0]
    assert choice.message.reasoning_content == call
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2}
    assert not choice.message.content
    reasoning, names, finish = "", [], None
    for chunk in chat(server, stream=True, **extra):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function and t.function.name]
            finish = c.finish_reason or finish
    assert (reasoning, names, finish) == (call, ["add"], "tool_calls")
