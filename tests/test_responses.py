"""OpenAI's Responses API (`POST /v1/responses`) against a real server on a tiny model, through the openai
client: the answer equals the chat route's for the same conversation, the stream's events come in OpenAI's order,
a reasoning parser's reasoning is an output item, and what the server does not do is refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from test_reasoning import FORCED as THINK
from test_reasoning import reasoning_server
from test_server import Server, _wait_metrics

# the reasoning tests' server; THINK is what a regex constraint makes its model write: a reasoning block, then
# the answer
server_fixture = pytest.fixture(reasoning_server, scope="module", name="server")


def respond(server: Server, **kwargs: Any) -> Any:
    kwargs = {"model": server.name, "max_output_tokens": 8, "temperature": 0, **kwargs}
    return server.client().responses.create(**kwargs)


def chat(server: Server, messages: list[dict[str, Any]], max_tokens: int = 8, **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.name,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra or None,  # type: ignore[arg-type]
    )


def test_a_text_input_is_answered_as_the_chat_route_answers_it(server: Server) -> None:
    got = respond(server, input="hello world")
    want = chat(server, [{"role": "user", "content": "hello world"}])
    assert got.id.startswith("resp_") and got.object == "response" and got.model == server.name
    assert got.output_text == want.choices[0].message.content
    assert [item.type for item in got.output] == ["message"]
    assert got.output[0].role == "assistant" and got.output[0].content[0].type == "output_text"
    # cut at max_output_tokens: incomplete, and says why
    assert (got.status, got.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert got.usage.input_tokens == want.usage.prompt_tokens and got.usage.output_tokens == 8
    assert got.usage.total_tokens == got.usage.input_tokens + 8
    assert (got.max_output_tokens, got.temperature, got.instructions) == (8, 0.0, None)


def test_instructions_and_messages_make_the_conversation(server: Server) -> None:
    got = respond(
        server,
        instructions="Answer briefly.",
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "No lists."}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "hello "},
                    {"type": "input_text", "text": "world"},
                ],
            },
        ],
    )
    want = chat(
        server,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "system", "content": "No lists."},
            {"role": "user", "content": "hello world"},
        ],
    )
    assert got.output_text == want.choices[0].message.content and got.instructions == "Answer briefly."
    # the next turn sends the answer's output items back as they came, with the new message
    later = respond(server, input=[{"role": "user", "content": "hello world"}, *[o.model_dump() for o in got.output],
                                   {"role": "user", "content": "and?"}])  # fmt: skip
    earlier = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": got.output_text}]
    assert (
        later.output_text
        == chat(server, [*earlier, {"role": "user", "content": "and?"}]).choices[0].message.content
    )


def test_the_stream_comes_as_openais_events(server: Server) -> None:
    whole = respond(server, input="hello world", max_output_tokens=6)
    events = list(respond(server, input="hello world", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == whole.output_text == last.output_text == events[-4].text
    assert last.usage.output_tokens == 6 and last.status == "incomplete"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.id == events[-2].item.id == last.output[0].id


def test_a_reasoning_parser_answers_the_reasoning_as_an_output_item(server: Server) -> None:
    body = {
        "regex": THINK,
        "logit_bias": {str(t): 100 for t in _tag_ids(server)},
    }  # the tags as tokens of their own
    got = respond(server, input="What is 2 + 2?", max_output_tokens=80, extra_body=body)
    assert got.status == "completed" and got.incomplete_details is None
    assert [item.type for item in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == "I add 2 and 2." and got.output_text == "It is 4."
    assert got.usage.output_tokens_details.reasoning_tokens > 0
    events = list(respond(server, input="What is 2 + 2?", max_output_tokens=80, stream=True, extra_body=body))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "I add 2 and 2." and events[-1].type == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    # sent back in the next turn, the reasoning item goes to the assistant message after it
    again = respond(server, input=[{"role": "user", "content": "What is 2 + 2?"},
                                   *[o.model_dump() for o in got.output], {"role": "user", "content": "and 3 + 3?"}],
                    max_output_tokens=80, extra_body=body)  # fmt: skip
    assert again.output_text == "It is 4."


def _tag_ids(server: Server) -> list[int]:
    ids = []
    for tag in ("<think>", "</think>"):
        status, got = server.request(
            "POST", "/tokenize", json.dumps({"prompt": tag, "add_special_tokens": False}).encode()
        )
        assert status == 200 and len(got["tokens"]) == 1, got  # one token each in this vocabulary
        ids += got["tokens"]
    return ids


def test_text_format_holds_the_output_to_a_schema(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text = {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}
    got = respond(server, input="a number", max_output_tokens=60, text=text)
    assert isinstance(json.loads(got.output_text)["n"], int)
    assert got.text.format.type == "json_schema"


REFUSED = {
    "store": {"store": True},
    "previous_response_id": {"previous_response_id": "resp_1"},
    "background": {"background": True},
    "tools[0].type": {"tools": [{"type": "web_search"}]},
    "tools[0].name": {"tools": [{"type": "function", "name": "no spaces"}]},
    "tool_choice": {"tool_choice": "required"},  # without tools
    "include": {"include": ["reasoning.encrypted_content"]},
    # this server splits reasoning off: the text's log-probabilities would have to be split token by token
    "include ": {"include": ["message.output_text.logprobs"]},
    "reasoning": {"reasoning": {"effort": "high"}},
    "truncation": {"truncation": "auto"},
    "top_logprobs": {"top_logprobs": 2},
    "input[0].type": {"input": [{"type": "item_reference", "id": "x"}]},
    "input[1].arguments": {
        "input": [
            {"role": "user", "content": "a"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
        ]
    },
    "input[0].content[0]": {
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    },
    "input[0].name": {"input": [{"role": "user", "content": "a", "name": "x"}]},
    "input[0].role": {"input": [{"role": "tool", "content": "a"}]},
    "input[0]": {
        "input": [{"type": "reasoning", "summary": [], "content": []}, {"role": "user", "content": "a"}]
    },
    "input": {"input": []},
    "text.format.type": {"text": {"format": {"type": "grammar"}}},
    "max_output_tokens": {"max_output_tokens": 0},
    "temperature": {"temperature": -1},
    "max_tokens": {"max_tokens": 5},
    "request_id": {"request_id": "a b"},
}


@pytest.mark.parametrize("param", list(REFUSED))
def test_what_the_server_does_not_do_is_refused_naming_the_field(server: Server, param: str) -> None:
    body = {"model": server.name, "input": "a", **REFUSED[param]}
    status, got = server.request("POST", "/v1/responses", json.dumps(body).encode())
    assert status == 400, got
    assert got["error"]["param"] == param.strip(), got


def test_request_id_names_the_response(server: Server) -> None:
    got = respond(server, input="a", max_output_tokens=1, extra_body={"request_id": "job-42"})
    assert got.id == "resp_job-42"
    with pytest.raises(openai.NotFoundError):
        respond(server, input="a", model="no-such-model")


# a function whose arguments the grammar bounds (an integer's digits are not: a random model writes them on)
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add one or two.",
    "parameters": {
        "type": "object",
        "properties": {"two": {"type": "boolean"}},
        "required": ["two"],
    },
}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_a_forced_tool_call_is_a_function_call_item(server: Server) -> None:
    # one call (the tiny model would write calls until max_output_tokens cut one)
    one = {"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 120}
    got = respond(server, input="add 2 and 3", **one)
    calls = [item for item in got.output if item.type == "function_call"]
    assert calls and got.status == "completed"
    assert all(c.name == "add" and c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert all(isinstance(json.loads(c.arguments)["two"], bool) for c in calls)
    # the same call the chat route makes for the same conversation and tools
    want = server.client().chat.completions.create(
        model=server.name,
        messages=[{"role": "user", "content": "add 2 and 3"}],
        tools=[_chat_tool(ADD)],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls or []
    ]
    # a named function: exactly one call of it
    named = respond(server, input="add", tools=[ADD], tool_choice={"type": "function", "name": "add"},
                    max_output_tokens=120)  # fmt: skip
    assert [item.type for item in named.output] == ["function_call"] and named.output[0].name == "add"


def test_a_streamed_call_comes_as_its_argument_deltas(server: Server) -> None:
    kwargs = {"input": "add 2 and 3", "tools": [ADD], "tool_choice": "required", "max_output_tokens": 120,
              "parallel_tool_calls": False}  # fmt: skip
    whole = respond(server, **kwargs)
    events = list(respond(server, stream=True, **kwargs))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [
        e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(added) == len(done) == len(calls) > 0
    for event, item in zip(added, done):
        pieces = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == item.id
        ]
        assert event.item.id == item.id and "".join(pieces) == item.arguments
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    assert events[-1].type == "response.completed"
    assert [(o.type, getattr(o, "arguments", None)) for o in events[-1].response.output] == [
        (o.type, getattr(o, "arguments", None)) for o in whole.output
    ]


def test_a_call_and_its_output_go_back_into_the_conversation(server: Server) -> None:
    call_args = '{"two": true}'
    items = [
        {"role": "user", "content": "add 2 and 3"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": call_args},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    got = respond(server, input=items, tools=[ADD], max_output_tokens=10)
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": call_args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]  # fmt: skip
    want = server.client().chat.completions.create(
        model=server.name,
        messages=messages,  # type: ignore[arg-type]
        tools=[_chat_tool(ADD)],  # type: ignore[list-item]
        max_tokens=10,
        temperature=0,
    )
    assert got.output_text == (want.choices[0].message.content or "")


def test_a_client_that_hangs_up_mid_stream_leaves_nothing_held(server: Server) -> None:
    events = respond(
        server, input="hello", max_output_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for event in events:
        if event.type == "response.output_text.delta":
            break
    events.close()  # the connection goes: the request is aborted, its row and pages freed
    m = _wait_metrics(server, lambda m: m["minisgl_requests_in_flight"] == 0)
    assert m["sglang:num_running_reqs"] == 0 and m["minisgl_kv_pages_held"] == 0
    assert m['minisgl_requests_finished_total{finish_reason="abort"}'] >= 1


def test_an_empty_answer_is_an_empty_message_streamed_or_whole(server: Server) -> None:
    status, got = server.request(
        "POST", "/tokenize", json.dumps({"prompt": "<|im_end|>", "add_special_tokens": False}).encode()
    )
    assert status == 200 and len(got["tokens"]) == 1, got
    eos = {"logit_bias": {str(got["tokens"][0]): 100}}  # the end of the answer as its first token
    whole = respond(server, input="a", extra_body=eos)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["message"]
    assert whole.output_text == "" and whole.usage.output_tokens == 1
    events = list(respond(server, input="a", stream=True, extra_body=eos))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [o.type for o in events[-1].response.output] == ["message"] and events[
        -1
    ].response.output_text == ""
