"""OpenAI's Responses API (`POST /v1/responses`): its request as the chat pipeline takes it, and its answer and
stream events as the openai client reads them (`client.responses.create`, `response.output_text`).

What it does: a text input or a list of message items (with `instructions` as the system message), the sampling
fields as on the chat route (`max_output_tokens` for `max_tokens`), `text.format` as `response_format`, a reasoning
parser's reasoning as a `reasoning` output item, function tools as the chat route takes them (calls as
`function_call` items; earlier calls and their outputs taken back as input items), and streams of `response.*`
events. What it does not do is refused naming the field: stored responses (`store: true`, `previous_response_id`,
`background`), tools other than functions, `include` other than the output text's log-probabilities (which a
reasoning parser or tools would have to split token by token), `reasoning` settings, `truncation: auto`, and other
input items.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pydantic import create_model

from minisgl.core import SamplingParams
from minisgl.server.protocol import (
    APIError,
    OpenAILabels,
    ServingOptions,
    _sampling_fields,
    _short,
    _wire_values,
    check_cache_salt,
    checked_params,
)
from minisgl.server.tools import parsed_arguments

# the sampling fields under their Responses names
_NAMES = {"max_tokens": "max_output_tokens"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# the content part types a message of each role may carry, as the openai client writes them
_PART_TYPES = {"user": "input_text", "system": "input_text", "assistant": "output_text"}
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_REASONING_KEYS = {"type", "id", "summary", "content", "status", "encrypted_content"}
_CALL_KEYS = {"type", "id", "call_id", "name", "arguments", "status"}
# what include may ask for: the output text's log-probabilities
LOGPROBS = "message.output_text.logprobs"
_OUTPUT_KEYS = {"type", "id", "call_id", "output", "status"}


class _ResponsesBase(OpenAILabels, ServingOptions):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool | None = None
    # function tools ({"type": "function", "name", "description", "parameters", "strict"}), as the chat route
    # takes them (server/tools.py, chat_tools)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # what this server does not do: refused unless absent or of the value that means "not used"
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None

    def check_fields(self) -> None:
        """Refuse what this server does not do, naming the field."""
        self.check_labels("responses")
        refused = [
            ("previous_response_id", self.previous_response_id, "no response is stored to continue; send the "
             "whole conversation in input"),
            ("background", self.background, "background responses are not supported"),
            ("reasoning", self.reasoning, "reasoning settings are not supported; a reasoning parser "
             "(--reasoning-parser) answers a thinking model's reasoning as an output item"),
        ]  # fmt: skip
        for name, value, why in refused:
            if value:
                raise APIError(why, name, "unsupported_parameter")
        unknown = [x for x in self.include or [] if x != LOGPROBS]
        if unknown:
            raise APIError(
                f"include {_short(unknown[0])} is not supported; only {LOGPROBS!r} is",
                "include",
                "unsupported_parameter",
            )
        if self.top_logprobs is not None and not (0 <= self.top_logprobs <= 20 and self.logprobs):
            raise APIError(
                f"top_logprobs={_short(self.top_logprobs)} is invalid: an integer in [0, 20], with include "
                f"[{LOGPROBS!r}] that returns them",
                "top_logprobs",
                "invalid_value",
            )
        if self.truncation not in (None, "disabled"):
            raise APIError(
                "truncation: auto is not supported; leave it out (disabled: a prompt over the context is refused)",
                "truncation",
                "unsupported_parameter",
            )
        check_cache_salt(self.cache_salt)

    @property
    def logprobs(self) -> bool:
        """The output text's log-probabilities asked for (include, with top_logprobs of them each)."""
        return LOGPROBS in (self.include or [])

    def messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: instructions first, then the input's messages (an earlier
        reasoning item goes to the assistant message after it, as its reasoning_content)."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise APIError("input is empty; send a text or at least one message", "input", "empty_prompt")
        reasoning: str | None = None
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "function_call":
                _only_keys(item, _CALL_KEYS, i)
                call = _call(item, i)
                if out and out[-1]["role"] == "assistant" and reasoning is None:
                    out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
                else:
                    out.append(self._with_reasoning({"role": "assistant", "content": "", "tool_calls": [call]},
                                                    reasoning, i))  # fmt: skip
                    reasoning = None
                continue
            if kind == "function_call_output":
                _only_keys(item, _OUTPUT_KEYS, i)
                out.append(
                    self._with_reasoning(_call_output(item, i), reasoning, i)
                )  # refused after reasoning
                continue
            if kind == "reasoning":
                _only_keys(item, _REASONING_KEYS, i)
                reasoning = _reasoning_text(item, i)
                continue
            if kind != "message":
                raise APIError(
                    f"input[{i}] is of type {_short(kind)}; only message, reasoning, function_call and "
                    "function_call_output items are supported",
                    f"input[{i}].type",
                    "unsupported_parameter",
                )
            _only_keys(item, _MESSAGE_KEYS, i)
            out.append(self._with_reasoning(_message(item, i), reasoning, i))
            reasoning = None
        if reasoning is not None:
            raise APIError(
                "the last input item is reasoning without the assistant message it led to",
                f"input[{len(self.input) - 1}]",
                "invalid_value",
            )
        return out

    @staticmethod
    def _with_reasoning(message: dict[str, Any], reasoning: str | None, i: int) -> dict[str, Any]:
        """The message of input[i], with the reasoning item before it (an assistant's only)."""
        if reasoning is None:
            return message
        if message["role"] != "assistant":
            raise APIError(
                f"input[{i - 1}] is a reasoning item not followed by the assistant message it led to",
                f"input[{i - 1}]",
                "invalid_value",
            )
        return {**message, "reasoning_content": reasoning}

    def sampling_params(self) -> SamplingParams:
        values = _wire_values(self, _NAMES)
        if values["temperature"] is None:
            values["temperature"] = 1.0  # OpenAI's default
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        names = dict(_NAMES)
        schema = _text_format(self.text)
        if schema is not None:
            given = [n for n in ("json_schema", "regex", "ebnf") if values[n] is not None]
            if given:
                raise APIError(
                    f"{given[0]} constrains the output which text.format constrains already; send one of them",
                    given[0],
                    "invalid_value",
                )
            values["json_schema"], names["json_schema"] = schema, "text.format.schema"
        return checked_params(values, names)


ResponsesRequest = create_model("ResponsesRequest", __base__=_ResponsesBase, **_sampling_fields(_NAMES))


def _only_keys(item: dict[str, Any], allowed: set[str], i: int) -> None:
    # null says nothing: the openai client's items, sent back as model_dump() gives them, carry its newer
    # fields so (a message's phase, a reasoning item's encrypted_content)
    extra = sorted(k for k, v in item.items() if k not in allowed and v is not None)
    if extra:
        raise APIError(
            f"Unrecognized request argument supplied: input[{i}].{extra[0]}",
            f"input[{i}].{extra[0]}",
            "unrecognized_argument",
        )


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(
            f"input[{i}].role={_short(role)} is invalid: it must be one of {', '.join(_ROLES)}",
            f"input[{i}].role",
            "invalid_value",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise APIError(
            f"input[{i}].content must be a text or a list of parts", f"input[{i}].content", "invalid_type"
        )
    want = _PART_TYPES[_ROLES[role]]
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != want or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(
                f"input[{i}].content[{j}] is {_short(kind)}; a {role} message takes {want} parts "
                f"({{'type': '{want}', 'text': ...}})",
                f"input[{i}].content[{j}]",
                "unsupported_content",
            )
        texts.append(part["text"])
    return {"role": _ROLES[role], "content": "".join(texts)}


def _call(item: dict[str, Any], i: int) -> dict[str, Any]:
    """An earlier function_call item as a chat message's tool call (its arguments parsed, as templates take them)."""
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str):
            raise APIError(f"input[{i}].{key} must be a string", f"input[{i}].{key}", "invalid_value")
    arguments = parsed_arguments(item.get("arguments"), f"input[{i}].arguments")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": arguments},
    }


def _call_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A function_call_output item as the chat's tool message."""
    for key in ("call_id", "output"):
        if not isinstance(item.get(key), str):
            raise APIError(f"input[{i}].{key} must be a string", f"input[{i}].{key}", "invalid_value")
    return {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """The Responses API's function tools in the chat route's shape ({"type": "function", "function": {...}})."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(
                f"tools[{i}] is of type {_short(kind)}; only function tools are supported",
                f"tools[{i}].type",
                "unsupported_parameter",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    """tool_choice in the chat route's shape: a function is {"type": "function", "name": ...} here."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def responses_param(e: APIError) -> APIError:
    """An error of the chat route's tool checks, naming the field as the Responses body spells it."""
    if e.param is not None:
        e.param = re.sub(r"^(tools\[\d+\])\.function\b", r"\1", e.param)
    return e


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
        for p in parts
    ):
        raise APIError(
            f"input[{i}].content must be a list of reasoning_text parts",
            f"input[{i}].content",
            "invalid_value",
        )
    return "".join(p["text"] for p in parts)


def _text_format(text: dict[str, Any] | None) -> str | None:
    """text.format as a JSON schema for the grammar engine (None: free text)."""
    fmt = (text or {}).get("format")
    extra = sorted(set(text or {}) - {"format", "verbosity"})
    if extra or (text or {}).get("verbosity") not in (None, "medium"):
        name = extra[0] if extra else "verbosity"
        raise APIError(f"text.{name} is not supported", f"text.{name}", "unsupported_parameter")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return '{"type": "object"}'
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                "text.format json_schema needs a schema (an object)", "text.format.schema", "invalid_value"
            )
        return json.dumps(schema)
    raise APIError(
        f"text.format type {_short(fmt.get('type'))} is not supported; use text, json_object or json_schema",
        "text.format.type",
        "unsupported_parameter",
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(
    reasoning: str, message: dict[str, Any], status: str, logprobs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """A whole answer's output items: its reasoning, its text (with its tokens' `logprobs` where asked), its calls
    (answer_message's chat message)."""
    item_status = _item_status(status)
    out = [reasoning_item(new_id("rs"), reasoning, item_status)] if reasoning else []
    calls = message.get("tool_calls") or []
    if message["content"] or not calls:
        out.append(message_item(new_id("msg"), message["content"] or "", item_status, logprobs))
    for c in calls:
        fn = c["function"]
        out.append(function_call_item(new_id("fc"), c["id"], fn["name"], fn["arguments"], item_status))
    return out


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def usage(prompt: int, cached: int, output: int, reasoning: int | None) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning or 0},
        "total_tokens": prompt + output,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details from the request's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


class ResponseStream:
    """The stream's events for one response, as its text comes: `feed` a reply's new reasoning and answer text,
    `finish` with the response as it ended. Items open as their first text comes (the reasoning first) and are
    closed in order; every event carries its sequence_number."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head  # the response object as it stands (status, output, usage updated here)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items so far, open or done
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item and its text
        self._message: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the function_call items by the parser's call index
        self._texts: dict[str, str] = {}
        self._logprobs: list[dict[str, Any]] = []  # the message text's tokens', where asked for
        self._held: list[dict[str, Any]] = []  # of them, those no delta has shown yet

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        response = dict(self.head, status="in_progress", output=[], usage=None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(
        self, reasoning: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Events of a reply's new reasoning and text (`logprobs`: its tokens', all of them the text's)."""
        out = []
        if reasoning:
            if self._reasoning is None:
                self._reasoning = reasoning_item(new_id("rs"), "", "in_progress")
                out.append(self._added(self._reasoning))
            item = self._reasoning
            self._texts[item["id"]] = self._texts.get(item["id"], "") + reasoning
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self._index(item),
                                   content_index=0, delta=reasoning))  # fmt: skip
        if text:
            out += self._close_reasoning()
            if self._message is None:
                out += self._open_message()
            item = self._message
            assert item is not None
            self._texts[item["id"]] = self._texts.get(item["id"], "") + text
            shown, self._held = self._held + (logprobs or []), []
            self._logprobs += logprobs or []
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index(item),
                                   content_index=0, delta=text, logprobs=shown))  # fmt: skip
        elif logprobs:
            # tokens whose text is held back (a character not yet whole): shown with the text that comes next
            self._held += logprobs
            self._logprobs += logprobs
        return out

    def finish(
        self, status: str, incomplete: dict[str, Any] | None, usage: dict[str, Any]
    ) -> list[dict[str, Any]]:
        out = self._close_reasoning(status)
        if not self._calls and not any(item["type"] == "message" for item in self.items):
            out += (
                self._open_message()
            )  # an answer of no text and no call is an empty message, as a whole one
        out += self._close_message(status)
        for item in self._calls.values():
            index = self._index(item)
            args = self._texts.get(item["id"], "")
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=args))  # fmt: skip
            done = function_call_item(item["id"], item["call_id"], item["name"], args, _item_status(status))
            self.items[index] = done
            out.append(self._event("response.output_item.done", output_index=index, item=done))
        response = dict(
            self.head, status=status, incomplete_details=incomplete, output=self.items, usage=usage
        )
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"
        )
        out.append(self._event(kind, response=response))
        return out

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        """A piece of tool call `index` (tool_parser.CallDelta): its first opens a function_call item (the text
        before it is done), the others add argument text."""
        out = []
        if call_id is not None:
            out += self._close_reasoning() + self._close_message()
            item = function_call_item(new_id("fc"), call_id, name or "", "", "in_progress")
            self._calls[index] = item
            out.append(self._added(item))
        item = self._calls[index]
        if arguments:
            self._texts[item["id"]] = self._texts.get(item["id"], "") + arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(item), delta=arguments))  # fmt: skip
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        item = self._message = message_item(new_id("msg"), None, "in_progress")
        self._texts[item["id"]] = ""
        added = self._added(item)
        part = self._event("response.content_part.added", item_id=item["id"], output_index=self._index(item),
                           content_index=0, part=output_text(""))  # fmt: skip
        return [added, part]

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._message
        if item is None:
            return []
        self._message = None
        text, index = self._texts[item["id"]], self._index(item)
        done = message_item(item["id"], text, _item_status(status), self._logprobs)
        self.items[index] = done
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=self._logprobs),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=output_text(text, self._logprobs)),
            self._event("response.output_item.done", output_index=index, item=done),
        ]  # fmt: skip

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _index(self, item: dict[str, Any]) -> int:
        return next(k for k, x in enumerate(self.items) if x["id"] == item["id"])

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._reasoning
        if item is None:
            return []
        self._reasoning = None
        text, index = self._texts[item["id"]], self._index(item)
        done = reasoning_item(item["id"], text, _item_status(status))
        self.items[index] = done
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text),
            self._event("response.output_item.done", output_index=index, item=done),
        ]  # fmt: skip


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"
