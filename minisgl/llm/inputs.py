"""The offline interface's prompts and conversations, checked before anything is scheduled.

`LLM.generate` takes what vLLM's takes: one prompt or a list, each a string, a list of token ids, or vLLM's
prompt dicts ({"prompt": text} or {"prompt_token_ids": ids}); or SGLang's keywords, `prompt=` or `input_ids=`.
`LLM.chat` takes one conversation or a list of them, each message checked as the server checks a request's
`messages` (roles, text parts, tool fields). A prompt of another shape is a ValueError that says which one and
what to pass, not an error from deep inside.
"""

from __future__ import annotations

import operator
import reprlib
from dataclasses import fields
from typing import Any

from minisgl.llm.options import put_once
from minisgl.params import SamplingParams
from minisgl.server.protocol import SGLANG_NAMES, APIError, checked_conversation, template_options
from minisgl.server.tools import ToolPlan, chat_messages, plan_tools
from minisgl.tokenizer.tool_parser import ToolSupport

Prompt = str | list[int]
SHAPES = "a string, a list of token ids, {'prompt': text} or {'prompt_token_ids': ids}"
# the keys of vLLM's prompt dicts taken (its others are for models of more than text, or for its own engine)
_DICT_KEYS = ("prompt", "prompt_token_ids")


def prompt_list(prompts: Any) -> list[Prompt]:
    """The prompts of a generate call: one prompt (a string or a dict) or a list of them."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts={reprlib.repr(prompts)} is invalid: pass a prompt or a list of prompts, each {SHAPES}"
        )
    return [_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def sglang_prompts(prompt: Any, input_ids: Any) -> tuple[list[Prompt], bool]:
    """The prompts of a generate call made with SGLang's keywords (its `Engine.generate(prompt=..., input_ids=...)`),
    one of the two: `prompt` a string or a list of them, `input_ids` a list of token ids or a list of such lists.
    Returns them and whether one prompt alone was given (SGLang then answers with one output, not a list)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass SGLang's prompt= (text) or input_ids= (token ids), one of them")
    if prompt is not None:
        return prompt_list(prompt), isinstance(prompt, str)
    one = (
        isinstance(input_ids, (list, tuple))
        and bool(input_ids)
        and not isinstance(input_ids[0], (list, tuple))
    )
    if one:
        return [token_ids(input_ids, "input_ids")], True
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(
            f"input_ids={reprlib.repr(input_ids)} is invalid: token ids, or a list of token-id lists"
        )
    return [token_ids(ids, f"input_ids[{i}]") for i, ids in enumerate(input_ids)], False


def _prompt(p: Any, where: str) -> Prompt:
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        other = sorted(str(k) for k in p if k not in _DICT_KEYS)
        if other:
            raise ValueError(
                f"{where} has {', '.join(map(repr, other))}, which minisgl does not take; {where} is {SHAPES}"
            )
        if len(p) != 1:
            raise ValueError(f"{where} has both 'prompt' and 'prompt_token_ids'; give one of them")
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise ValueError(f"{where}['prompt'] is {reprlib.repr(p['prompt'])}; it must be a string")
            return p["prompt"]
        return token_ids(p["prompt_token_ids"], f"{where}['prompt_token_ids']")
    if isinstance(p, int) and not isinstance(p, bool):
        raise ValueError(
            f"{where} is the integer {p}; a prompt of token ids is a list, and prompts are a list of prompts: "
            "[[1, 2, 3]] for one"
        )
    return token_ids(p, where)


def token_ids(ids: Any, where: str) -> list[int]:
    """`ids` as a list of ints: a list or tuple (or a 1-D integer tensor or array) of integers, none a bool or a
    float (a fraction would be dropped, and True read as 1)."""
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{where} is {reprlib.repr(ids)}; a prompt is {SHAPES}")
    out = []
    for j, t in enumerate(ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{where}[{j}] is {reprlib.repr(t)}; token ids are integers") from None
    return out


def conversation_list(
    conversations: Any, add_generation_prompt: bool | None = None, continue_final_message: bool = False
) -> tuple[list[list[dict[str, Any]]], list[dict[str, bool]]]:
    """The conversations of a chat call, each checked as a request's messages: one conversation (a list of
    message dicts, as vLLM's LLM.chat takes it) or a list of them; and how the template ends each (the server's
    rule for vLLM's add_generation_prompt and continue_final_message)."""
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
        conversations = [conversations]
    if not isinstance(conversations, (list, tuple)):
        raise ValueError(
            f"conversations={reprlib.repr(conversations)} is invalid: pass a conversation (a list of messages, "
            "each {'role': ..., 'content': ...}) or a list of them"
        )
    out, options = [], []
    for c, raw in enumerate(conversations):
        try:
            texts, messages = checked_conversation(raw)
            out.append(chat_messages(texts, messages))
            options.append(template_options(add_generation_prompt, continue_final_message, messages[-1].role))
        except APIError as e:
            raise ValueError(f"conversations[{c}]: {e.message}") from None
    return out, options


def tool_plan(tools: Any, support: ToolSupport) -> ToolPlan:
    """vLLM's `tools` of LLM.chat checked as a request's (OpenAI's function tools), and how the conversation
    carries them: to a template that renders tools, or described in a system message where it renders none."""
    if tools is not None and not isinstance(tools, list):
        raise ValueError(
            f"tools={reprlib.repr(tools)} is invalid: pass a list of {{'type': 'function', ...}} tools"
        )
    try:
        return plan_tools(tools, None, None, support)
    except APIError as e:
        raise ValueError(e.message) from None


# SGLang's names of sampling fields (max_new_tokens, ...) -> ours
_OURS = {theirs: ours for ours, theirs in SGLANG_NAMES.items() if theirs != ours}


def sampling_list(sampling_params: Any, count: int) -> list[SamplingParams]:
    """generate's `sampling_params`: None (the defaults), one SamplingParams for every prompt, or one a prompt;
    each may be a dict too, as SGLang's Engine.generate takes it (its names or ours)."""
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [_as_params(sampling_params, "sampling_params")] * count  # one object: checked once
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(
            f"sampling_params={reprlib.repr(sampling_params)} is invalid: pass a SamplingParams (or a dict of its "
            "fields), or one a prompt"
        )
    if len(sampling_params) != count:
        raise ValueError(f"{count} prompts but {len(sampling_params)} sampling_params; pass one or one each")
    return [_as_params(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]


def _as_params(value: Any, where: str) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} is {reprlib.repr(value)}; it must be a SamplingParams or a dict of its fields"
        )
    known = {f.name for f in fields(SamplingParams)}
    ours: dict[str, Any] = {}
    given: dict[str, str] = {}  # our name -> the key it came by
    for key, v in value.items():
        name = _OURS.get(key, key)
        if name not in known:
            raise ValueError(
                f"{where} has {key!r}, which is not a sampling parameter; they are {', '.join(sorted(known))} "
                f"(and SGLang's {', '.join(sorted(_OURS))})"
            )
        put_once(ours, given, name, key, v, where, ValueError)
    return SamplingParams(**ours)
