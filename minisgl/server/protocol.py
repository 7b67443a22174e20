"""Request bodies of the API (OpenAI's and SGLang's /generate), their checks, and OpenAI-style errors.

Types are checked strictly (a string is not a number, 5.0 is not an integer); value ranges are
SamplingParams.validate's, so the server and the offline LLM refuse the same things with the same words.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Annotated, Any, TypeVar, Union, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Tag,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)

from minisgl.constrained.grammar import check_grammar, choice_regex
from minisgl.params import (
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    InvalidParam,
    RequestError,
    SamplingParams,
)
from minisgl.scheduler.check import prompt_too_long
from minisgl.tokenizer.reasoning import ReasoningFormat

# completions a call (prompts x n): each is a request of its own in the queue, its state held until the call
# ends, so a 4 MiB body of one-token prompts with n=128 would otherwise ask for 10^8 of them
MAX_CALL_COMPLETIONS = 16384
# the roles of OpenAI's chat API; the role is written into the prompt as is, so no other is let through
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # a field this server does not know is refused (OpenAI's "Unrecognized request argument"), never dropped
    model_config = ConfigDict(strict=True, extra="forbid")


# ---- prompts: their shape, and their length against the context --------------------------------------
_SHAPES: dict[str, Any] = {
    "str": str,
    "list[str]": list[str],
    "list[int]": list[int],
    "list[list[int]]": list[list[int]],
}


def _by_shape(*shapes: str) -> Any:
    """A union of prompt shapes that validates a value against the one member its shape names.

    Trying every member, as a plain union does, costs a second on a body of a million token ids: each
    member that fails reports every element. Read by its first element, the body costs milliseconds, and
    a value of no member's shape is refused naming them all.
    """

    def tag(value: Any) -> str | None:
        if isinstance(value, str):
            return "str" if "str" in shapes else None
        if not isinstance(value, list):
            return None
        if not value:  # the first list member's (an empty prompt is refused later, with its own words)
            return next((s for s in shapes if s != "str"), None)
        first = value[0]
        shape = (
            "list[str]"
            if isinstance(first, str)
            else "list[list[int]]"
            if isinstance(first, list)
            else "list[int]"
        )
        return shape if shape in shapes else None

    members = tuple(Annotated[_SHAPES[s], Tag(s)] for s in shapes)
    return Annotated[
        Union[members],  # noqa: UP007 (a union built from a tuple)
        Discriminator(
            tag, custom_error_type="invalid_type", custom_error_message=f"expected one of {', '.join(shapes)}"
        ),
    ]


TEXTS = _by_shape("str", "list[str]")
IDS = _by_shape("list[int]", "list[list[int]]")
PROMPTS = _by_shape("str", "list[str]", "list[int]", "list[list[int]]")


def refuse_over_context(value: Any, param: str, info: ValidationInfo, items: str = "tokens") -> Any:
    """`value` as it is, unless it has a list of more `items` than the context length given in the
    validation context ({"max_seq_len": n}) leaves for a prompt: then an APIError, raised before the rest
    of the body is read (the tokenizer would refuse it anyway, later and dearer).

    `items` "tokens": a list of token ids, or a list of such lists; "messages": a conversation, each of
    whose messages the chat template writes as at least one token.
    """
    max_seq_len = (info.context or {}).get("max_seq_len")
    if max_seq_len is None or not isinstance(value, list) or not value or isinstance(value[0], str):
        return value  # texts are counted by the tokenizer, which reads only as much as it needs
    if items == "messages":
        count, at_least = len(value), True
    elif isinstance(value[0], list):
        count, at_least = max(len(v) if isinstance(v, list) else 0 for v in value), False
    else:
        count, at_least = len(value), False
    if count >= max_seq_len:
        e = prompt_too_long(count - 1 if at_least else count, max_seq_len, at_least)
        raise APIError(str(e), param, e.code)
    return value


def longer_than_a_call(value: Any) -> bool:
    """Whether `value`, as JSON gave it, is a list of more prompts (texts or lists of ids) than a call takes."""
    return isinstance(value, list) and len(value) > MAX_CALL_COMPLETIONS and isinstance(value[0], (str, list))


def refuse_too_many_prompts(value: Any, param: str) -> Any:
    """`value` as it is, unless it is a list of more prompts than a call takes: then an APIError, raised
    before its elements are read."""
    if longer_than_a_call(value):
        check_call_size(len(value), 1, param)
    return value


# a JSON string, its escapes included (the unrolled form: ten times faster than an alternation on long texts)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OTHER_LISTS = 64  # lists a body's other fields may hold besides its prompts (stop, a schema's arrays, ...)


def refuse_many_prompt_lists(body: bytes, param: str) -> None:
    """Refuse, before it is parsed, a body with more lists than a call's prompts may be: a 4 MiB body of
    one-token prompts ([[5],[5],...]) takes a second to parse under the interpreter lock, where counting its
    brackets takes milliseconds (and scanning past its strings, only when the raw count is that high, tens)."""
    limit = MAX_CALL_COMPLETIONS + _OTHER_LISTS
    if body.count(b"[") > limit and _JSON_STRING.sub(b"", body).count(b"[") > limit:
        raise APIError(
            f"this call holds more than {limit} lists; a call takes at most {MAX_CALL_COMPLETIONS} "
            "completions (prompts x n): send the prompts over several calls",
            param,
            "too_many_completions",
        )


def check_call_size(num_prompts: int, n: int, param: str) -> None:
    """Refuse a call of more than MAX_CALL_COMPLETIONS completions, naming `param` (the prompts' field, or n)."""
    if num_prompts * n > MAX_CALL_COMPLETIONS:
        asked = f"{num_prompts} prompts" if n == 1 else f"{num_prompts} prompts x n={n}"
        raise APIError(
            f"this call asks for {num_prompts * n} completions ({asked}); a call takes at most "
            f"{MAX_CALL_COMPLETIONS}: send the prompts over several calls",
            param,
            "too_many_completions",
        )


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


# Fields of OpenAI's API that change nothing this server computes, accepted so that clients which always
# send them work; any value of theirs is answered as if it were absent. (A field with a value that would
# change an answer, e.g. store: true, is refused by _refuse_fields.)
NO_OP_FIELDS = {
    "user": "an end-user id for the provider's abuse monitoring; nothing to monitor here",
    "safety_identifier": "the newer name of user",
    "metadata": "tags of stored completions; nothing is stored (store: true is refused)",
    "prompt_cache_key": "a routing hint for provider-side prompt caching; the prefix cache needs no hint",
    "service_tier": "a billing tier; only auto and default, which mean this server as it is",
    "store": "false (the default) only: this server keeps no completions",
}


# The one table between the wire and SamplingParams: a field's name in OpenAI bodies and in SGLang's
# /generate sampling_params, where it differs. The request models below are built from SamplingParams'
# fields, so a new sampling field reaches every endpoint (logprobs is asked differently by each API).
_OPENAI_NAMES = {"max_tokens": "max_tokens"}
SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}
# asked differently by each API, so fields of the request models themselves
_OWN_FIELDS = ("logprobs", "n")
# JSON object keys are strings: logit_bias's token ids arrive as "42"
_WIRE_TYPES: dict[str, Any] = {"stop": str | list[str], "logit_bias": dict[str, float]}


def _sampling_fields(names: dict[str, str]) -> dict[str, Any]:
    hints = get_type_hints(SamplingParams)
    return {
        names.get(f.name, f.name): (_WIRE_TYPES.get(f.name, hints[f.name]) | None, None)
        for f in fields(SamplingParams)
        if f.name not in _OWN_FIELDS
    }


def checked_params(values: dict[str, Any], names: dict[str, str], prefix: str = "") -> SamplingParams:
    """SamplingParams from a body's sampling values (keyed by field); a bad value is an APIError naming
    the parameter as the body calls it."""
    params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
    try:
        params.validate()
    except InvalidParam as e:
        alias = names.get(e.param or "", e.param or "")
        raise APIError(str(e.named(alias)), prefix + alias, e.code) from e
    try:
        # a grammar that does not compile is a 400 now, before any stream starts
        check_grammar(params, names)
    except RequestError as e:
        param = names.get(e.param or "", e.param or "") if e.param else None
        raise APIError(str(e), prefix + param if param else None, e.code) from e
    return params


def _wire_values(body: BaseModel, names: dict[str, str], prefix: str = "") -> dict[str, Any]:
    values = {
        f.name: getattr(body, names.get(f.name, f.name))
        for f in fields(SamplingParams)
        if f.name not in _OWN_FIELDS
    }
    if values["logit_bias"] is not None:
        values["logit_bias"] = _token_keys(values["logit_bias"], prefix + "logit_bias")
    return values


def _token_keys(bias: dict[str, float], param: str) -> dict[int, float]:
    """logit_bias with its keys ("42") as token ids."""
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(
                f"{param} has the key {_short(key)}; its keys are token ids (integers >= 0)",
                param,
                "invalid_value",
            )
        out[int(key)] = value
    return out


# a document field's name: the chat template reads it as a key
_WORD = re.compile(r"\w{1,64}")
# the longest cache_salt taken: a secret of a few hundred bits, not a payload (it keys the prefix cache)
MAX_CACHE_SALT = 1024
# the longest request_id taken: an id, not a payload (it is written into every chunk of a stream)
MAX_REQUEST_ID = 256


def _num_choices(n: int | None, param: str) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise APIError(f"{param}={_short(n)} is invalid: it must be in [1, {MAX_N}]", param, "invalid_value")
    return n


def _checked_prompts(prompts: list[Prompt], param: str) -> list[Prompt]:
    """The prompts, refused when one is empty or has a token id wider than 64 bits, which no message
    can carry (the vocabulary is checked with the rest of the request, by check_request)."""
    if not prompts or any(len(x) == 0 for x in prompts):
        raise APIError("the prompt is empty; send at least one token", param, "empty_prompt")
    for p in prompts:
        if not isinstance(p, str) and (min(p) < INT64_MIN or max(p) > INT64_MAX):
            raise APIError(
                f"'{param}' has a token id wider than 64 bits; token ids index the vocabulary",
                param,
                "invalid_token_ids",
            )
    return prompts


class OpenAILabels(_Strict):
    """OpenAI's fields of every generation route that change nothing computed here (NO_OP_FIELDS), and store."""

    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    store: bool | None = None

    def check_labels(self, kept: str) -> None:
        """Refuse store: true (nothing is stored: `kept` names what) and a service tier other than this server."""
        if self.store:
            raise APIError(
                f"store: true is not supported; this server keeps no {kept}", "store", "unsupported_parameter"
            )
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(
                f"service_tier={_short(self.service_tier)} is not supported; use auto or default",
                "service_tier",
                "unsupported_parameter",
            )


class ServingOptions(_Strict):
    """vLLM's (and SGLang's priority) request options of how a call is served, on the OpenAI routes alike."""

    # the request's place in the queue under priority scheduling (queue_priority)
    priority: int | None = None
    # a request shares the prefix cache only with requests of the same salt (CacheManager.cache_key)
    cache_salt: str | None = None
    # the client's name for the call, in the answer's id (checked_request_id)
    request_id: str | None = None

    def checked_request_id(self) -> str | None:
        return checked_request_id(self.request_id)


class _OpenAIBase(OpenAILabels, ServingOptions):
    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's: spaces between control tokens kept in the text (by the sampling field skip_special_tokens:
    # false); true (the default) is transformers' decode as it is, false refused
    spaces_between_special_tokens: bool | None = None
    # vLLM's: the prompt's and the choice's token ids in the answer
    return_token_ids: bool | None = None
    # vLLM's: logprobs name each token "token_id:N" instead of its text
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: only the prompt's last tokens are kept (kept_prompt_tokens)
    truncate_prompt_tokens: int | None = None
    # structured output as OpenAI (response_format) and vLLM ask for it; SGLang's fields are sampling fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def num_choices(self) -> int:
        return _num_choices(self.n, "n")

    def kept_prompt_tokens(self, max_seq_len: int, max_tokens: int) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all): k >= 1 keeps k; -1
        (vLLM's "the model's length") as many as leave room for `max_tokens`, at least one."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        if keep == -1:
            return max_seq_len - min(max_tokens, max_seq_len - 1)
        if not 1 <= keep <= INT64_MAX:
            raise APIError(
                f"truncate_prompt_tokens={_short(keep)} is invalid: it must be an integer >= 1 (the prompt's "
                "last tokens kept), or -1 (as many as leave room for max_tokens)",
                "truncate_prompt_tokens",
                "invalid_value",
            )
        return keep

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_fields(self) -> None:
        """Refuse the fields this body sets to something the server does not do (an APIError naming it)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", "stream_options", "invalid_value"
            )
        self.check_labels("completions")
        check_cache_salt(self.cache_salt)
        if self.spaces_between_special_tokens is False:
            raise APIError(
                "spaces_between_special_tokens: false is not supported; control tokens kept in the text "
                "(skip_special_tokens: false) are written as the tokenizer decodes them (true, the default)",
                "spaces_between_special_tokens",
                "unsupported_parameter",
            )

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, names: dict[str, str] = _OPENAI_NAMES
    ) -> SamplingParams:
        """`names`: the fields' names in this body, where a bad value is reported."""
        values = _wire_values(self, _OPENAI_NAMES)
        # OpenAI's defaults: temperature 1; max_tokens left out means the engine's default
        if values["temperature"] is None:
            values["temperature"] = 1.0
        values.update(max_tokens=max_tokens, logprobs=logprobs)
        names = dict(names)
        grammar = _grammar(self, values)
        if grammar is not None:
            wire, name, text = grammar
            values[name], names[name] = text, wire
        return checked_params(values, names)


def _grammar(body: _OpenAIBase, values: dict[str, Any]) -> tuple[str, str, str] | None:
    """The one output constraint of an OpenAI body: (the name the body used, the SamplingParams field,
    its text). response_format and vLLM's guided_* / structured_outputs map to json_schema, regex or
    ebnf; two constraints at once are an APIError naming the second."""
    found = [
        (name, name, values[name]) for name in ("json_schema", "regex", "ebnf") if values[name] is not None
    ]
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", "json_schema", '{"type": "object"}'))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                    "response_format.json_schema.schema",
                    "invalid_value",
                )
            found.append(("response_format.json_schema.schema", "json_schema", json.dumps(schema)))
        elif kind != "text":
            raise APIError(
                f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                "response_format.type",
                "unsupported_parameter",
            )
    vllm = [
        ("guided_json", body.guided_json),
        ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice),
        ("guided_grammar", body.guided_grammar),
    ]
    vllm += [(f"structured_outputs.{k}", v) for k, v in (body.structured_outputs or {}).items()]
    for wire, value in vllm:
        if value is not None:
            found.append(_vllm_grammar(wire, value))
    if len(found) > 1:
        raise APIError(
            f"{found[1][0]} and {found[0][0]} both constrain the output; send only one",
            found[1][0],
            "invalid_value",
        )
    return found[0] if found else None


def _vllm_grammar(wire: str, value: Any) -> tuple[str, str, str]:
    key = wire.rsplit(".", 1)[-1].removeprefix("guided_")
    if key == "json" and isinstance(value, (dict, str)):
        return wire, "json_schema", value if isinstance(value, str) else json.dumps(value)
    if key in ("regex", "grammar") and isinstance(value, str):
        return wire, "regex" if key == "regex" else "ebnf", value
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(f"{wire} must be a non-empty list of non-empty strings", wire, "invalid_value")
        return wire, "regex", choice_regex(value)
    if key not in ("json", "regex", "grammar"):
        raise APIError(
            f"{wire} is not supported; use json, regex, choice or grammar", wire, "unsupported_parameter"
        )
    raise APIError(f"{wire} has the wrong type: got {_short(value)}", wire, "invalid_type")


_OpenAIRequest = create_model("_OpenAIRequest", __base__=_OpenAIBase, **_sampling_fields(_OPENAI_NAMES))


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # the speaker's name: given to the chat template, which may write it
    # fields of the assistant messages OpenAI answers with, which clients send back as they got them:
    # null says nothing; a value is refused, as the chat template has no place for it
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    # an assistant's earlier calls and a tool's result (checked in server/tools.py)
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    # an assistant's earlier reasoning as a server with a reasoning parser answered it (SGLang's name, and vLLM's
    # newer one): given to the chat template as reasoning_content, which it keeps or drops (Qwen3's keeps it
    # only after the last user message)
    reasoning_content: str | None = None
    reasoning: str | None = None


# vLLM's default: the prompt ends with the assistant's header, so the model writes a new message
_ADD_GENERATION_PROMPT = True


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # checked and applied by server/tools.py
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: how the conversation ends in the prompt (a new assistant message, or the last one continued)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # vLLM's and SGLang's: more variables for the chat template (e.g. Qwen3's enable_thinking); the tokenizer
    # worker takes only names the template reads (tokenizer/template_kwargs.py)
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: the reasoning in reasoning_content (default, with --reasoning-parser), and streamed as it comes
    # or whole once it ends
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    # vLLM's: the answer's content starts with the last message's, where that message is the assistant's (the
    # one continue_final_message continues)
    echo: bool | None = None
    # vLLM's: documents for a RAG template (checked_documents), written by it as client text
    documents: list[dict[str, str]] | None = None
    # vLLM's: a template from the request (behind its --trust-request-chat-template); refused by check_fields
    chat_template: str | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.chat_template is not None:
            raise APIError(
                "a request's own chat_template is not taken (its Jinja would run on the server); the server's "
                "template is the model's, or the one it was started with (--chat-template FILE): leave "
                "chat_template out",
                "chat_template",
                "unsupported_parameter",
            )

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_context(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_over_context(value, "messages", info, "messages")

    @property
    def template_options(self) -> dict[str, bool]:
        """How the chat template renders the conversation; both asked at once is an APIError (as in vLLM)."""
        last = self.messages[-1].role if self.messages else None
        return template_options(self.add_generation_prompt, self.continue_final_message, last)

    def chat(self) -> list[dict[str, str]]:
        return chat_texts(self.messages)

    def checked_documents(self) -> list[dict[str, str]] | None:
        """documents, each an object of text fields whose names are words (the template reads them by name)."""
        for j, doc in enumerate(self.documents or []):
            bad = next((key for key in doc if not _WORD.fullmatch(key)), None)
            if bad is not None or not doc:
                raise APIError(
                    f"documents[{j}] needs fields named by letters, digits and '_' (such as title and text); "
                    f"got {_short(bad if bad is not None else doc)}",
                    f"documents[{j}]",
                    "invalid_value",
                )
        return self.documents or None

    def echoed(self, texts: list[dict[str, Any]]) -> str:
        """What echo puts before each choice's content: the last message's text where it is the assistant's
        (`texts`: chat()'s), else nothing, as vLLM has it."""
        if self.echo and texts and texts[-1]["role"] == "assistant":
            return texts[-1]["content"] or ""
        return ""

    def reasoning_plan(self, fmt: ReasoningFormat | None) -> tuple[ReasoningFormat | None, bool]:
        """The reasoning format the answer is split by (None: not split) and whether the reasoning streams
        as it comes; fields asking for a split the server does not make are an APIError."""
        if fmt is None:
            # what the server does without a parser (no split, everything streamed) is taken as said
            if self.separate_reasoning:
                raise _needs_parser("separate_reasoning: true")
            if self.stream_reasoning is False:
                raise _needs_parser("stream_reasoning: false")
            return None, True
        if self.separate_reasoning is False:
            if self.stream_reasoning is False:
                raise APIError(
                    "stream_reasoning: false holds back the reasoning in its own field, which "
                    "separate_reasoning: false turns off; set one of them",
                    "stream_reasoning",
                    "invalid_value",
                )
            return None, True
        return fmt, self.stream_reasoning is not False

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = None
        if self.logprobs:
            logprobs = 0 if self.top_logprobs is None else self.top_logprobs
        elif self.top_logprobs:
            raise APIError("top_logprobs needs logprobs: true", "logprobs", "invalid_value")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise APIError(
                f"top_logprobs={_short(logprobs)} is invalid: it must be in [0, 20]",
                "top_logprobs",
                "invalid_value",
            )
        if self.max_completion_tokens is None:
            return self._sampling_params(max_tokens, logprobs)
        return self._sampling_params(
            max_tokens, logprobs, {**_OPENAI_NAMES, "max_tokens": "max_completion_tokens"}
        )


def checked_request_id(rid: str | None) -> str | None:
    """vLLM's request_id as the answer's id takes it (after "chatcmpl-", "cmpl-" or "resp_"): 1 to MAX_REQUEST_ID
    printable characters, no whitespace, so that it reads as one word in the server's log and in the id."""
    if rid is not None and not (
        0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable() and not any(c.isspace() for c in rid)
    ):
        raise APIError(
            f"request_id={_short(rid)} is invalid: it must be 1 to {MAX_REQUEST_ID} printable characters "
            "without whitespace",
            "request_id",
            "invalid_value",
        )
    return rid


def check_cache_salt(salt: str | None) -> None:
    """vLLM's cache_salt: 1 to MAX_CACHE_SALT characters."""
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise APIError(
            f"cache_salt is invalid: it must be a string of 1 to {MAX_CACHE_SALT} characters (vLLM asks for "
            "a random one, 43 characters of base64 for 256 bits)",
            "cache_salt",
            "invalid_value",
        )


def queue_priority(priority: int | None, enabled: bool) -> int:
    """A request's `priority` as the scheduler takes it (UserMsg.priority). Without priority scheduling only 0
    (vLLM's default) or none is taken: another value would be a promise of an order the queue does not keep."""
    if priority is None:
        return 0
    if not INT64_MIN <= priority <= INT64_MAX:
        raise APIError(
            f"priority={_short(priority)} is invalid: it must be an integer in [-2**63, 2**63 - 1]",
            "priority",
            "invalid_value",
        )
    if priority and not enabled:
        raise APIError(
            "priority orders the queue under priority scheduling, which is off on this server; start it with "
            "--enable-priority-scheduling (or --scheduling-policy priority), or leave priority out",
            "priority",
            "unsupported_parameter",
        )
    return priority


def _needs_parser(asked: str) -> APIError:
    """The error for a reasoning field (`asked`, "name: value") a server without a reasoning parser cannot do."""
    name = asked.split(":")[0]
    return APIError(
        f"{asked} needs a reasoning parser; start the server with --reasoning-parser (qwen3 or deepseek-r1)",
        name,
        "unsupported_parameter",
    )


def template_options(add: bool | None, cont: bool | None, last_role: str | None) -> dict[str, bool]:
    """add_generation_prompt and continue_final_message as the chat template takes them (vLLM's fields; add
    unset is true unless the last message is continued): both true, or a continued message that is not the
    assistant's, is an APIError."""
    cont = bool(cont)
    if cont and add:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true; the prompt either "
            "continues the last message or starts a new one",
            "continue_final_message",
            "invalid_value",
        )
    if cont and last_role is not None and last_role != "assistant":
        raise APIError(
            "continue_final_message needs the last message to be the assistant's, which it continues",
            "continue_final_message",
            "invalid_value",
        )
    add = _ADD_GENERATION_PROMPT if add is None else add
    return {"add_generation_prompt": add and not cont, "continue_final_message": cont}


def chat_texts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The role, text (text parts joined), name and earlier reasoning of each message, checked; an APIError
    naming `messages[i]...` otherwise."""
    if not messages:
        raise APIError("messages is empty; send at least one message", "messages", "empty_prompt")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(
                f"messages[{i}].role={_short(m.role)} is invalid: it must be one of {', '.join(CHAT_ROLES)}",
                f"messages[{i}].role",
                "invalid_value",
            )
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": _text_content(m, i)}
        if m.name is not None:
            message["name"] = m.name
        reasoning = _reasoning_of(m, i)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


class _Conversation(_Strict):
    messages: list[ChatMessage]


def checked_conversation(raw: Any) -> tuple[list[dict[str, str]], list[ChatMessage]]:
    """A conversation given as plain dicts (the offline `LLM.chat`'s) checked as a request's `messages`: its
    chat_texts and its messages, or the APIError a request would get."""
    try:
        messages = _Conversation.model_validate({"messages": raw}).messages
    except ValidationError as e:
        raise _validation_error(e) from e
    return chat_texts(messages), messages


def _reasoning_of(message: ChatMessage, i: int) -> str | None:
    """An assistant message's earlier reasoning, under either name (the same text when both are sent, as an
    answer of this server carries both)."""
    given = [(name, getattr(message, name)) for name in ("reasoning_content", "reasoning")]
    given = [(name, value) for name, value in given if value is not None]
    if not given:
        return None
    name = given[0][0]
    if message.role != "assistant":
        raise APIError(
            f"messages[{i}].{name} belongs to assistant messages", f"messages[{i}].{name}", "invalid_value"
        )
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise APIError(
            f"messages[{i}] has a reasoning_content and a reasoning that differ; send one of them",
            f"messages[{i}].reasoning",
            "invalid_value",
        )
    return given[0][1]


def _text_content(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                f"messages[{i}].content has a part of type {part.get('type')!r}; only text parts "
                "({'type': 'text', 'text': ...}) are supported",
                f"messages[{i}].content",
                "unsupported_content",
            )
        texts.append(part["text"])
    return "".join(texts)


Prompt = str | list[int]


class CompletionRequest(_OpenAIRequest):
    prompt: PROMPTS
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: whether a text prompt gets the tokenizer's special tokens (its BOS); default true
    add_special_tokens: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_within_context(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_over_context(value, "prompt", info)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_a_call_takes(cls, value: Any) -> Any:
        return refuse_too_many_prompts(value, "prompt")

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the answer is the prompt alone (an evaluation harness's log-likelihood)."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[Prompt]:
        if self.suffix:
            raise APIError("suffix is not supported; leave it out", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise APIError("best_of is not supported; leave it out", "best_of", "unsupported_parameter")
        p = self.prompt
        prompts: list[Prompt] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)  # type: ignore[list-item]
        return _checked_prompts(prompts, "prompt")

    def sampling_params(self) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(
                f"logprobs={_short(self.logprobs)} is invalid: it must be in [0, 20]",
                "logprobs",
                "invalid_value",
            )
        # echo alone runs one step, whose token the answer leaves out
        return self._sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs)


# SGLang's names for the sampling parameters of /generate
GenerateSamplingParams = create_model(
    "GenerateSamplingParams", __base__=_Strict, n=(int | None, None), **_sampling_fields(SGLANG_NAMES)
)


class GenerateRequest(_Strict):
    text: TEXTS | None = None
    input_ids: IDS | None = None
    sampling_params: GenerateSamplingParams | None = None  # type: ignore[valid-type]
    stream: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    priority: int | None = None  # as for the OpenAI routes (queue_priority)
    # SGLang's: the call's id, or one a prompt of a batch, as meta_info.id (request_ids)
    rid: str | list[str] | None = None
    # SGLang's: the logprobs' token texts (the third entry of each), or None there
    return_text_in_logprobs: bool | None = None
    # SGLang's: with return_logprob, the prompt position the prompt's log-probabilities start at (-1: none)
    logprob_start_len: int | None = None

    @field_validator("input_ids")
    @classmethod
    def _ids_within_context(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_over_context(value, "input_ids", info)

    @field_validator("text", "input_ids", mode="before")
    @classmethod
    def _prompts_a_call_takes(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_too_many_prompts(value, info.field_name or "text")

    def prompts(self) -> list[Prompt]:
        if (self.text is None) == (self.input_ids is None):
            raise APIError("send exactly one of 'text' and 'input_ids'", "text", "invalid_value")
        if self.text is not None:
            prompts: list[Prompt] = [self.text] if isinstance(self.text, str) else list(self.text)
        else:
            ids = self.input_ids or []
            prompts = [ids] if not ids or isinstance(ids[0], int) else list(ids)  # type: ignore[list-item]
        return _checked_prompts(prompts, "text" if self.text is not None else "input_ids")

    @property
    def num_choices(self) -> int:
        return _num_choices(self.sampling_params.n if self.sampling_params else None, "sampling_params.n")

    def request_ids(self, num_prompts: int) -> list[str] | None:
        """rid checked: one id for one prompt, a list of one id a prompt for a batch (each as request_id)."""
        rid = self.rid
        if rid is None:
            return None
        rids = [rid] if isinstance(rid, str) else rid
        if len(rids) != num_prompts or (isinstance(rid, str) and num_prompts != 1):
            raise APIError(
                f"rid has {len(rids)} ids for {num_prompts} prompts; send one id a prompt (a list for a batch)",
                "rid",
                "invalid_value",
            )
        for r in rids:
            try:
                checked_request_id(r)
            except APIError as e:
                raise APIError(str(e).replace("request_id", "rid", 1), "rid", "invalid_value") from e
        return rids

    @property
    def input_logprobs_from(self) -> int | None:
        """SGLang's logprob_start_len checked: the prompt position the prompt's log-probabilities start at, or None
        for none (-1 or left out). It is a part of return_logprob's answer, so without it a start is refused."""
        start = self.logprob_start_len
        if start is None or start == -1:
            return None
        if not 0 <= start <= INT64_MAX:
            raise APIError(
                f"logprob_start_len={_short(start)} is invalid: it must be -1 (no prompt log-probabilities) or a "
                "prompt position >= 0",
                "logprob_start_len",
                "invalid_value",
            )
        if not self.return_logprob:
            raise APIError(
                "logprob_start_len starts the prompt's log-probabilities that return_logprob: true returns; send "
                "return_logprob: true, or leave logprob_start_len out",
                "logprob_start_len",
                "invalid_value",
            )
        return start

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params or GenerateSamplingParams()
        values = _wire_values(sp, SGLANG_NAMES, "sampling_params.")
        if values["max_tokens"] is None:
            values["max_tokens"] = 128  # SGLang's default
        values["logprobs"] = (self.top_logprobs_num or 0) if self.return_logprob else None
        if self.input_logprobs_from is not None:
            # the prompt's entries are computed whole and cut at the start (GenerateFormat)
            values["prompt_logprobs"] = max(values["prompt_logprobs"] or 0, self.top_logprobs_num or 0)
        names = {**SGLANG_NAMES, "logprobs": "top_logprobs_num"}
        try:
            return checked_params(values, names, "sampling_params.")
        except APIError as e:
            if e.param == "sampling_params.top_logprobs_num":  # a top-level field of the body
                e.param = "top_logprobs_num"
            raise


T = TypeVar("T", bound=BaseModel)


def parse_body(model: type[T], body: bytes, max_seq_len: int | None = None) -> T:
    """The request body as `model`; malformed JSON or a wrong field is an APIError saying what to fix.
    With `max_seq_len`, a prompt of token ids or messages that cannot fit it is refused as it is read."""
    try:
        return model.model_validate_json(body, context={"max_seq_len": max_seq_len})
    except ValidationError as e:
        raise _validation_error(e) from e


def _split(loc: tuple[Any, ...]) -> tuple[str | None, str | None]:
    """(parameter path, union member) of an error location such as ('prompt', 'list[int]', 0)."""
    path = ""
    for part in loc:
        if isinstance(part, str) and _is_type_tag(part):
            return path or None, part  # pydantic names the union member it tried; the path ends there
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None, None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(
            f"the request body is not valid JSON ({first['msg']}); send a JSON object", None, "invalid_json"
        )
    if not first["loc"]:
        return APIError("the request body must be a JSON object", None, "invalid_type")
    param, member = _split(first["loc"])
    if first["type"] == "extra_forbidden":
        # OpenAI's words for a field it does not know
        return APIError(f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    if first["type"] == "missing":
        return APIError(f"'{param}' is required", param, "missing_required_parameter")
    if member is not None:
        members = [m for m in (_split(err["loc"]) for err in errors) if m[0] == param and m[1] is not None]
        kinds = list(dict.fromkeys(m[1] for m in members if m[1]))
        expected = f"one of {', '.join(kinds)}" if len(kinds) > 1 else kinds[0]
        return APIError(
            f"'{param}' has the wrong type: expected {expected}; got {_short(first['input'])}",
            param,
            "invalid_type",
        )
    if first["type"] == "invalid_type":  # a value of no prompt shape (_by_shape)
        return APIError(
            f"'{param}' has the wrong type: {first['msg']}; got {_short(first['input'])}",
            param,
            "invalid_type",
        )
    return APIError(f"'{param}': {first['msg']}; got {_short(first['input'])}", param, "invalid_type")
