"""Prompt fields are read as the one shape their JSON has, and a list longer than the context is refused
as the body is read: a hostile body of a million token ids or messages costs the server milliseconds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from minisgl.server.protocol import (
    MAX_CALL_COMPLETIONS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    check_call_size,
    parse_body,
    refuse_many_prompt_lists,
)
from minisgl.server.tokens_api import DetokenizeRequest, TokenizeRequest

CONTEXT = 64


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_prompt_shape_is_read_as_itself(prompt: Any, prompts: list[Any]) -> None:
    req = parse_body(CompletionRequest, _body(prompt=prompt), CONTEXT)
    assert req.prompt == prompt and req.prompts() == prompts


@pytest.mark.parametrize("prompt", [5, {"a": 1}, None, True, [1.5], [1, "a"], [["a"]], ["a", 1], [[1], 2]])
def test_a_prompt_of_no_shape_is_a_400_naming_the_field(prompt: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, _body(prompt=prompt), CONTEXT)
    assert e.value.param == "prompt" and e.value.code == "invalid_type", e.value.message


def test_a_value_of_no_shape_is_told_the_shapes_there_are() -> None:
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, _body(prompt={"a": 1}), CONTEXT)
    assert "str, list[str], list[int], list[list[int]]" in e.value.message
    with pytest.raises(APIError) as e:
        parse_body(GenerateRequest, _body(input_ids="abc"), CONTEXT)
    assert e.value.param == "input_ids" and "list[int], list[list[int]]" in e.value.message


def test_an_empty_prompt_list_gets_the_empty_prompt_error() -> None:
    for model, field, param in [
        (CompletionRequest, "prompt", "prompt"),
        (GenerateRequest, "input_ids", "input_ids"),
        (GenerateRequest, "text", "text"),
    ]:
        req = parse_body(model, _body(**{field: []}), CONTEXT)
        with pytest.raises(APIError) as e:
            req.prompts()
        assert e.value.code == "empty_prompt" and e.value.param == param


def test_a_long_list_with_one_bad_element_is_checked_as_one_shape() -> None:
    # a plain union tries every member, and each failing one reports every element: thousands of errors
    body = _body(prompt=[1] * 5000 + ["a"])
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate_json(body)
    assert len(e.value.errors()) == 1 and e.value.errors()[0]["loc"] == ("prompt", "list[int]", 5000)


@pytest.mark.parametrize(
    "model, fields, param",
    [
        (CompletionRequest, {"prompt": [7] * CONTEXT}, "prompt"),
        (CompletionRequest, {"prompt": [[7], [7] * CONTEXT]}, "prompt"),
        (GenerateRequest, {"input_ids": [7] * CONTEXT}, "input_ids"),
        (GenerateRequest, {"input_ids": [[7] * (CONTEXT + 5)]}, "input_ids"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}] * CONTEXT}, "messages"),
    ],
)
def test_a_list_longer_than_the_context_is_refused_as_it_is_read(
    model: type[Any], fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as e:
        parse_body(model, _body(**fields), CONTEXT)
    assert e.value.param == param and e.value.code == "context_length_exceeded"
    assert f"at most {CONTEXT - 1} prompt tokens" in e.value.message
    parse_body(model, _body(**fields))  # without a context length, the tokenizer worker refuses it later


@pytest.mark.parametrize(
    "model, fields",
    [
        (CompletionRequest, {"prompt": [7] * (CONTEXT - 1)}),
        (CompletionRequest, {"prompt": ["x" * 10 * CONTEXT] * (2 * CONTEXT)}),  # texts: the tokenizer counts
        (GenerateRequest, {"input_ids": [[7] * (CONTEXT - 1)] * (2 * CONTEXT)}),
        (GenerateRequest, {"text": "x" * 10 * CONTEXT}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}] * (CONTEXT - 1)}),
    ],
)
def test_what_may_fit_the_context_is_read_whole(model: type[Any], fields: dict[str, Any]) -> None:
    parse_body(model, _body(**fields), CONTEXT)


def test_the_token_endpoints_read_their_shapes() -> None:
    assert parse_body(TokenizeRequest, _body(prompt=["a", "b"])).prompt == ["a", "b"]
    assert parse_body(DetokenizeRequest, _body(tokens=[[1], [2, 3]])).tokens == [[1], [2, 3]]
    with pytest.raises(APIError) as e:
        parse_body(TokenizeRequest, _body(prompt=[1, 2]))
    assert e.value.param == "prompt" and "str, list[str]" in e.value.message


def test_a_list_of_more_prompts_than_a_call_takes_is_refused_as_it_is_read() -> None:
    """A 4 MiB body holds a million one-token prompts: refused before they are read one by one."""
    over = MAX_CALL_COMPLETIONS + 1
    for model, field, value in [
        (CompletionRequest, "prompt", [[1]] * over),
        (CompletionRequest, "prompt", ["a"] * over),
        (GenerateRequest, "input_ids", [[1]] * over),
        (GenerateRequest, "text", ["a"] * over),
    ]:
        with pytest.raises(APIError) as e:
            parse_body(model, _body(**{field: value}), CONTEXT)
        assert e.value.param == field and e.value.code == "too_many_completions", e.value.message
        assert f"{over} completions" in e.value.message and "several calls" in e.value.message
    # as many as a call takes are read; one prompt of that many token ids is one prompt
    assert (
        len(parse_body(CompletionRequest, _body(prompt=["a"] * MAX_CALL_COMPLETIONS)).prompts())
        == MAX_CALL_COMPLETIONS
    )
    assert parse_body(CompletionRequest, _body(prompt=[1] * over)).prompts() == [[1] * over]


def test_prompts_times_n_over_a_calls_completions_names_n() -> None:
    check_call_size(MAX_CALL_COMPLETIONS // 128, 128, "n")
    with pytest.raises(APIError) as e:
        check_call_size(MAX_CALL_COMPLETIONS // 128 + 1, 128, "n")
    assert e.value.param == "n" and e.value.code == "too_many_completions"
    assert f"{MAX_CALL_COMPLETIONS // 128 + 1} prompts x n=128" in e.value.message


def test_a_body_of_more_lists_than_a_call_takes_is_refused_before_it_is_parsed() -> None:
    """[[5], [5], ...] at 4 MiB takes a second to parse; its brackets are counted in milliseconds first."""
    over = MAX_CALL_COMPLETIONS + 65
    with pytest.raises(APIError) as e:
        refuse_many_prompt_lists(_body(prompt=[[5]] * over, n=128), "prompt")
    assert e.value.param == "prompt" and e.value.code == "too_many_completions"
    assert "several calls" in e.value.message
    # brackets inside strings, escaped quotes among them, are text: such a body is read as usual
    refuse_many_prompt_lists(_body(prompt='x = [[1, 2], [3]] "q" \\' * over), "prompt")
    refuse_many_prompt_lists(_body(prompt=["[", '"[', "\\"] * over), "prompt")
    # as many one-token prompts as a call takes, with a few other lists beside them, are read as usual
    refuse_many_prompt_lists(_body(prompt=[[5]] * MAX_CALL_COMPLETIONS, stop=["a"] * 32), "prompt")


def test_tokenize_and_detokenize_batches_longer_than_a_call_takes_are_refused_unread() -> None:
    over = MAX_CALL_COMPLETIONS + 1
    for model, field, value in [
        (TokenizeRequest, "prompt", ["a"] * over),
        (DetokenizeRequest, "tokens", [[1]] * over),
    ]:
        with pytest.raises(APIError) as e:
            parse_body(model, _body(**{field: value}), CONTEXT)
        assert e.value.param == field and e.value.code == "too_many_prompts", e.value.message
        assert f"a batch of {over}" in e.value.message
    assert (
        len(parse_body(TokenizeRequest, _body(prompt=["a"] * MAX_CALL_COMPLETIONS)).prompt)
        == MAX_CALL_COMPLETIONS
    )  # type: ignore[arg-type]
    # a chat of more messages than the context has tokens: the worker would refuse it after rendering them all
    with pytest.raises(APIError) as e:
        parse_body(TokenizeRequest, _body(messages=[{"role": "user", "content": "a"}] * CONTEXT), CONTEXT)
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
