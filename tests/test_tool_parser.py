"""Tool calls in output text: each format read whole and streamed, split at every position."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.tokenizer.tool_parser import (
    FORMATS,
    CallDelta,
    ToolCallParser,
    default_parser,
    parse_tool_calls,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "CET", "note": 'say "hi" {not json}'}

# (format, output text, content wanted, calls wanted [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    (
        "qwen",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "Let me check.",
        [("get_weather", WEATHER)],
    ),
    (
        "qwen",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "note": "say \\"hi\\" {not json}"}}\n'
        "</tool_call>",
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    # keys in another order: sent whole once the object is complete
    (
        "qwen",
        '<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "qwen",
        "No call here, only a < sign and <tool_ text.",
        "No call here, only a < sign and <tool_ text.",
        [],
    ),
    # a marker followed by no call is content as written
    ("qwen", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET", "note": "say \\"hi\\" {not json}"}}',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    # JSON that is no call, and JSON after text, are content
    ("llama3", '{"city": "Paris"}', '{"city": "Paris"}', []),
    (
        "llama3",
        'The JSON is {"name": "x", "parameters": {}}',
        'The JSON is {"name": "x", "parameters": {}}',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET", "note": "say \\"hi\\" {not json}"}}]',
        None,
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "Sure.",
        [("get_weather", WEATHER)],
    ),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    # the marker is a special token the detokenizer leaves out: a list of calls opening the output is calls
    (
        "mistral",
        ' [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [("get_weather", WEATHER)],
    ),
    ("mistral", "[1, 2] and [3]", "[1, 2] and [3]", []),
    ("mistral", '[{"a": 1}]', '[{"a": 1}]', []),
]


def _reassemble(deltas: list[Any]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) from stream pieces, as a client joins OpenAI's deltas."""
    content = "".join(d for d in deltas if isinstance(d, str))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                assert d.index not in calls and d.name is not None and d.arguments == ""
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_a_whole_output_gives_its_content_and_calls(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    got = parse_tool_calls(text, FORMATS[fmt])
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got.calls)
    assert len({c.id for c in got.calls}) == len(got.calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_a_stream_split_anywhere_reassembles_to_the_whole_output(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], *text[cut:]]):
            parser = ToolCallParser(FORMATS[fmt])
            deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
            got_content, got_calls = _reassemble(deltas)
            assert got_content == content, (cut, pieces)
            assert [(n, json.loads(a)) for _, n, a in got_calls] == calls, (cut, pieces)


def test_a_stream_sends_text_before_a_call_at_once_and_holds_only_a_possible_marker() -> None:
    parser = ToolCallParser(FORMATS["qwen"])
    assert parser.feed("Checking the weather <tool") == ["Checking the weather"]
    assert parser.feed("_call>\n") == []
    first = parser.feed('{"name": "get_weather", "arguments": {"ci')
    assert len(first) == 2 and first[0].name == "get_weather" and first[0].arguments == ""
    assert first[1].arguments == '{"ci'
    assert [d.arguments for d in parser.feed('ty": "Paris"}}')] == ['ty": "Paris"}']  # type: ignore[union-attr]
    assert parser.feed("\n</tool_call>") == [] and parser.finish() == []
    # a '<' that turns out to be no marker comes out with the next text
    parser = ToolCallParser(FORMATS["qwen"])
    assert parser.feed("a <") == ["a"]
    assert parser.feed("b") == [" <b"]


def test_a_cut_call_or_invalid_arguments_leave_the_whole_text_as_content() -> None:
    cut = '<tool_call>{"name": "f", "arguments": {"x": 1'
    assert parse_tool_calls(cut, FORMATS["qwen"]).calls == []
    assert parse_tool_calls(cut, FORMATS["qwen"]).content == cut
    bad = '<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>'
    assert parse_tool_calls(bad, FORMATS["qwen"]).content == bad
    # cut before the name is known, after whole calls: still no calls, the text as it is
    one = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    for cut in (
        one + '\n<tool_call>{"na',
        one + "\n<tool_call>{",
        one + '<tool_call>{"name": "g", "arguments": {',
    ):
        assert parse_tool_calls(cut, FORMATS["qwen"]).calls == []
        assert parse_tool_calls(cut, FORMATS["qwen"]).content == cut
    assert parse_tool_calls(bad, FORMATS["qwen"]).content == bad


def test_max_calls_keeps_the_first_calls_only() -> None:
    text = CASES[1][1]
    got = parse_tool_calls(text, FORMATS["qwen"], max_calls=1)
    assert [c.name for c in got.calls] == ["get_weather"] and got.content is None
    parser = ToolCallParser(FORMATS["qwen"], max_calls=1)
    deltas = parser.feed(text) + parser.finish()
    assert {d.index for d in deltas if isinstance(d, CallDelta)} == {0}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_what_a_format_writes_it_reads_back(fmt: str) -> None:
    calls = [("get_weather", WEATHER), ("get_time", TIME)]
    got = parse_tool_calls(FORMATS[fmt].write(calls), FORMATS[fmt])
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls and got.content is None


def test_the_parser_follows_the_template_then_the_architecture() -> None:
    assert default_parser("{% if tools %}<tool_call>{% endif %}", "llama") == "qwen"
    assert default_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral") == "mistral"
    assert default_parser("Environment: ipython <|python_tag|>", "llama") == "llama3"
    assert default_parser("{% for t in tools %}{{ t }}{% endfor %}", "mistral") == "mistral"
    # a template that renders no tools (the default model's ChatML) gets the <tool_call> format
    assert default_parser("<|im_start|>{{ m['content'] }}", "llama") == "qwen"
    assert default_parser(None, None) == "qwen"


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    # any text before the calls, but for one that could itself open calls (JSON at the start of the output)
    text=st.text(max_size=20).filter(lambda t: t.strip() and t.strip()[0] not in "{["),
    calls=st.lists(
        st.tuples(
            st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
            st.dictionaries(st.text(max_size=8), _values, max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_any_text_and_calls_read_back_whole_and_streamed(
    fmt: str, text: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    written = FORMATS[fmt].write(calls)
    # a Llama call list opens the output, or follows <|python_tag|>
    output = text.strip() + " " + ("<|python_tag|>" if fmt == "llama3" else "") + written
    got = parse_tool_calls(output, FORMATS[fmt])
    assert got.content == text.strip()
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    parser = ToolCallParser(FORMATS[fmt])
    bounds = sorted({min(c, len(output)) for c in cuts} | {0, len(output)})
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in parser.feed(output[a:b])] + parser.finish()
    content, streamed = _reassemble(deltas)
    assert content == got.content
    assert [(n, a) for _, n, a in streamed] == [(c.name, c.arguments) for c in got.calls]
