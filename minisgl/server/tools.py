"""Tools in chat requests: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked, brought to the
model, and enforced.

The tools reach the model through the chat template (`apply_chat_template(tools=...)`). Many templates
ignore that argument (the default model's ChatML one does): the model would then never hear of the tools,
so they are described in the system prompt instead, with the call format the server's parser reads
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` by default); earlier calls in the conversation
are written in that format too, since such a template writes only a message's content.

`tool_choice` "required" or a named function forces the output, with the grammar engine, to be exactly
calls in the parser's format whose arguments match the function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from minisgl.constrained.grammar import check_grammar, repeated_json_ebnf
from minisgl.params import RequestError, SamplingParams
from minisgl.server.protocol import APIError
from minisgl.tokenizer.tool_parser import FORMATS, Delta, ToolFormat, ToolSupport, parse_tool_calls

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_CHOICES = ("auto", "none", "required")


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its sampling and its answer."""

    # the calls are parsed out of the output in this format; None: no parsing
    format: ToolFormat | None = None
    max_calls: int | None = None  # parallel_tool_calls false: one
    template_tools: list[dict[str, Any]] | None = None  # given to the chat template
    prompt: str | None = None  # the tools described for a template that renders none
    grammar: str | None = None  # EBNF forcing the output into calls (tool_choice required or named)
    # earlier calls are written as text in it (for a template that renders no tools)
    text_format: ToolFormat | None = None

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template gets it: with the tools' system prompt where the template renders
        no tools, and earlier calls written as text for such a template."""
        if self.text_format is None:
            return messages
        fmt = self.text_format
        # a message of role and content alone (most) is left as it is
        out = [_calls_as_text(m, fmt) if len(m) > 2 else m for m in messages]
        if self.prompt is not None:
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + self.prompt}
            else:
                out.insert(0, {"role": "system", "content": self.prompt})
        return out

    def constrain(self, params: SamplingParams) -> SamplingParams:
        if self.grammar is None:
            return params
        if params.grammar is not None:
            raise APIError(
                "tool_choice forces the output into tool calls; it cannot be combined with another output "
                "constraint (response_format, json_schema, regex, ebnf, guided_*, structured_outputs)",
                "tool_choice",
                "invalid_value",
            )
        return replace(params, ebnf=self.grammar)


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, support: ToolSupport
) -> ToolPlan:
    """The request's tools checked (an APIError names the bad field) and what they mean for it."""
    functions = _checked_tools(tools)
    choice = _checked_choice(tool_choice, functions)
    fmt = FORMATS[support.parser]
    # a template that renders no tools writes no earlier calls either: they are written as text
    text_format = None if support.renders_tools else fmt
    if choice == "none" or not functions:
        return ToolPlan(text_format=text_format)
    max_calls = 1 if parallel is False else None
    plan = ToolPlan(fmt, max_calls, text_format=text_format)
    if support.renders_tools:
        plan.template_tools = tools
    else:
        plan.prompt = _describe(tools or [], fmt)
    if choice == "required":
        plan.grammar = _calls_grammar(fmt, functions, max_calls)
    elif choice != "auto":
        # a named function is one call of it, as OpenAI answers
        plan.max_calls = 1
        plan.grammar = _calls_grammar(fmt, {choice: functions[choice]}, 1)
    return plan


def _checked_tools(tools: list[Any] | None) -> dict[str, tuple[int, dict[str, Any]]]:
    """{name: (index, parameters schema)} of the request's function tools."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(
                f"{where} must be an object {{'type': 'function', 'function': {{...}}}}",
                where,
                "invalid_type",
            )
        _no_other_keys(tool, _TOOL_KEYS, where)
        if tool.get("type") != "function":
            raise APIError(
                f"{where}.type={tool.get('type')!r} is not supported; only 'function' tools are",
                f"{where}.type",
                "invalid_value",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(
                f"{where}.function must be an object with a 'name'", f"{where}.function", "invalid_type"
            )
        _no_other_keys(fn, _FUNCTION_KEYS, f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got {name!r}",
                f"{where}.function.name",
                "invalid_value",
            )
        if name in out:
            raise APIError(f"two tools are named {name!r}", f"{where}.function.name", "invalid_value")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(
                f"{where}.function.parameters must be a JSON schema object",
                f"{where}.function.parameters",
                "invalid_type",
            )
        for key, kind in (("description", str), ("strict", bool)):
            if key in fn and not isinstance(fn[key], kind):
                raise APIError(
                    f"{where}.function.{key} must be a {kind.__name__}",
                    f"{where}.function.{key}",
                    "invalid_type",
                )
        out[name] = (i, params)
    return out


def _no_other_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise APIError(
            f"{where}.{unknown[0]} is not a field of a tool; the fields are {', '.join(sorted(allowed))}",
            f"{where}.{unknown[0]}",
            "unsupported_parameter",
        )


def _checked_choice(choice: Any, functions: dict[str, Any]) -> str:
    """'auto', 'none', 'required' or the name of the function the call must be."""
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in _CHOICES:
        name = choice
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        if functions and name not in functions:
            raise APIError(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(functions)})",
                "tool_choice",
                "invalid_value",
            )
    else:
        raise APIError(
            "tool_choice must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
            "invalid_value",
        )
    if not functions and name not in ("auto", "none"):
        raise APIError(
            "tool_choice needs tools; send 'tools' or leave tool_choice out", "tool_choice", "invalid_value"
        )
    return name


def _calls_grammar(
    fmt: ToolFormat, functions: dict[str, tuple[int, dict[str, Any]]], max_calls: int | None
) -> str:
    """EBNF of one call (max_calls 1) or several, each to one of `functions` with arguments matching its
    parameters, in the format's text."""
    cases = []
    for name, (i, params) in functions.items():
        text = json.dumps(params)
        try:
            check_grammar(SamplingParams(json_schema=text))
        except RequestError as e:
            where = f"tools[{i}].function.parameters"
            raise APIError(f"{where} is not a usable JSON schema: {e}", where, "invalid_value") from e
        cases.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, fmt.arguments_key: params},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
        )
    call = cases[0] if len(cases) == 1 else {"anyOf": cases}
    return _grammar_of(fmt.name, json.dumps(call), max_calls)


@lru_cache(maxsize=256)
def _grammar_of(format_name: str, call: str, max_calls: int | None) -> str:
    # cached: an agent sends the same tools with every turn, and building the grammar takes milliseconds
    fmt = FORMATS[format_name]
    if fmt.open:  # the calls are one JSON array (mistral)
        array = {"type": "array", "items": json.loads(call), "minItems": 1}
        if max_calls:
            array["maxItems"] = max_calls
        return repeated_json_ebnf(json.dumps(array), before=fmt.lead)
    separator = None if max_calls == 1 else fmt.separator
    return repeated_json_ebnf(
        call, before=fmt.lead + fmt.call_prefix, after=fmt.call_suffix, separator=separator
    )


def _describe(tools: list[dict[str, Any]], fmt: ToolFormat) -> str:
    example = fmt.write([("<function name>", {"<parameter>": "<value>"})])
    return (
        "You can call these functions (described as JSON schemas):\n<tools>\n"
        + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        + "\n</tools>\nTo call a function, answer with the call, nothing else:\n"
        + example
    )


def chat_messages(texts: list[dict[str, str]], messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation (role and text of each message, and the ChatMessages they came from) with the tool
    fields of its messages."""
    out = texts
    for i, raw in enumerate(messages):
        # most messages have no tool fields: a conversation of many messages is not copied for them
        if raw.tool_calls is not None or raw.tool_call_id is not None or raw.role == "tool":
            out = texts[:] if out is texts else out
            out[i] = _checked_message(texts[i], i, raw.tool_calls, raw.tool_call_id)
    return out


def _checked_message(m: dict[str, Any], i: int, tool_calls: Any, tool_call_id: Any) -> dict[str, Any]:
    """A chat message with its tool fields checked: an assistant's calls (arguments parsed, as chat templates
    take them) and a tool result's call id."""
    if m["role"] == "tool":
        if not isinstance(tool_call_id, str):
            raise APIError(
                f"messages[{i}] has role 'tool' and needs the 'tool_call_id' of the call it answers",
                f"messages[{i}].tool_call_id",
                "missing_required_parameter",
            )
        return {**m, "tool_call_id": tool_call_id}
    if tool_call_id is not None:
        raise APIError(
            f"messages[{i}].tool_call_id belongs to messages with role 'tool'",
            f"messages[{i}].tool_call_id",
            "invalid_value",
        )
    if tool_calls is None:
        return m
    where = f"messages[{i}].tool_calls"
    if m["role"] != "assistant":
        raise APIError(f"{where}: only assistant messages carry tool calls", where, "invalid_value")
    calls = []
    for k, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                f"{where}[{k}] must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                f"{where}[{k}]",
                "invalid_value",
            )
        parsed = parsed_arguments(fn.get("arguments", "{}"), f"{where}[{k}].function.arguments")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": parsed}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return {**m, "tool_calls": calls}


def parsed_arguments(args: Any, param: str) -> dict[str, Any]:
    """An earlier call's arguments (a JSON object in a string) as chat templates take them: parsed."""
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise APIError(f"{param} must be a JSON object in a string", param, "invalid_value")
    return parsed


def _calls_as_text(m: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    """A message for a template that writes only role and content: earlier calls become content text."""
    calls = m.get("tool_calls")
    out = {"role": m["role"], "content": m["content"]}
    if calls:
        text = fmt.write([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        out["content"] = (m["content"] + "\n" if m["content"] else "") + text
    return out


def answer_message(text: str, plan: ToolPlan) -> tuple[dict[str, Any], bool]:
    """An answer's message, its calls parsed out when the request had tools; and whether it has calls."""
    if plan.format is None:
        return {"role": "assistant", "content": text}, False
    parsed = parse_tool_calls(text, plan.format, plan.max_calls)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
    ]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True


def stream_delta(delta: Delta) -> dict[str, Any]:
    """A parser's piece as OpenAI's stream sends it: a call's first piece has index, id, type, name and
    empty arguments; the next ones carry argument text."""
    if isinstance(delta, str):
        return {"content": delta}
    call: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        call.update(id=delta.id, type="function", function={"name": delta.name, "arguments": ""})
    else:
        call["function"] = {"arguments": delta.arguments}
    return {"tool_calls": [call]}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    # OpenAI's reason for an answer that ends in calls; a cut one keeps "length"
    return "tool_calls" if has_calls and reason == "stop" else reason
