"""Tool calls in a model's output text: the formats models are trained on, found while the text streams.

Three formats, named as vLLM's and SGLang's --tool-call-parser names them:

- qwen: Qwen 2.5 / 3 and Hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call;
- llama3: Llama 3.1+, `{"name": ..., "parameters": {...}}` (calls separated by ';'), at the start of the
  output or after `<|python_tag|>`; a JSON answer elsewhere in a text is no call;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, the marker left out at the start.

One parser serves streaming and whole answers (a whole answer is one feed), so both read a text the same
way. Text that may still become a call marker is held back until the next text decides it. A call is sent
as soon as its name is known, its arguments in fragments as they arrive (OpenAI's stream shape); a call
whose keys come in another order is sent whole once its object is complete. What is not a call (a marker
followed by no call object) is content, as written; whitespace next to a call is not content (it is held
back until text other than a call follows it). A stream cannot take back a call it has begun: an output
cut inside one ends the stream with that call unfinished (finish_reason "length"), where the whole answer
gives the text as content (parse_tool_calls).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # text that opens a run of calls
    lead: str = ""  # what a model writes before a run of calls
    # a run may also open without its marker at the start of the output: the marker is a special token
    # (Llama's <|python_tag|>, Mistral's [TOOL_CALLS]) that the detokenizer leaves out of the text
    at_start: bool = False
    arguments_key: str = "arguments"
    open: str = ""  # after the marker, before the first call (mistral's '[')
    close: str = ""  # after the last call
    call_prefix: str = ""  # around each call (qwen's <tool_call> ... </tool_call>)
    call_suffix: str = ""
    separator: str = ""  # between calls of one run

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """The text of `calls` [(name, arguments)] in this format, as a model writes it."""
        body = [
            self.call_prefix + json.dumps({"name": n, self.arguments_key: a}) + self.call_suffix
            for n, a in calls
        ]
        return self.lead + self.open + self.separator.join(body) + self.close


FORMATS = {
    "qwen": ToolFormat(
        "qwen", ("<tool_call>",), call_prefix="<tool_call>\n", call_suffix="\n</tool_call>", separator="\n"
    ),
    "llama3": ToolFormat(
        "llama3", ("<|python_tag|>",), at_start=True, arguments_key="parameters", separator="; "
    ),
    "mistral": ToolFormat(
        "mistral", ("[TOOL_CALLS]",), at_start=True, lead="[TOOL_CALLS]", open="[", close="]", separator=", "
    ),
}
# vLLM's and SGLang's names for the same formats (--tool-call-parser takes them too)
ALIASES = {"hermes": "qwen", "qwen25": "qwen", "llama3_json": "llama3"}


def default_parser(chat_template: str | None, model_type: str | None) -> str:
    """The format a model writes calls in: told by its chat template's markers, else by its architecture.

    A template that renders no tools gets them described in a system prompt in the qwen format (the
    default model, a Llama-architecture chat model with a ChatML template, is such a case).
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return "qwen"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "tools" in template and model_type is not None:
        if model_type.startswith("mistral") or model_type.startswith("mixtral"):
            return "mistral"
        if model_type == "llama":
            return "llama3"
    return "qwen"


@dataclass(frozen=True)
class ToolSupport:
    """How the served model takes tools: the format its calls are read in, and whether its chat template
    writes the tools into the prompt."""

    parser: str = "qwen"
    renders_tools: bool = False


def detect_tool_support(tokenizer: Any, model_dir: str) -> ToolSupport:
    model_type = None
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            model_type = json.load(f).get("model_type")
    template = getattr(tokenizer, "chat_template", None)
    return ToolSupport(
        default_parser(template if isinstance(template, str) else None, model_type),
        template_renders_tools(tokenizer),
    )


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the tools it is given into the prompt (many ignore them)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = "probe_" + uuid.uuid4().hex[:12]
    tool = {
        "type": "function",
        "function": {"name": probe, "description": "", "parameters": {"type": "object"}},
    }
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[tool], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template that refuses tools renders none
        return False
    return probe in text


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text of the arguments
    complete: bool = False


@dataclass
class CallDelta:
    """A stream piece of call `index`: its first piece has id and name, the others argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = str | CallDelta  # content text, or a piece of a call


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*')


class _JsonScanner:
    """Finds where the JSON object or array opening at `start` ends, reading only text it has not read yet:
    arguments that stream in many pieces are read once, not once a piece."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.found: int | None = None

    def end(self, text: str) -> int | None:
        """The index just after the value in `text` (which only grows), None while it is incomplete."""
        if self.found is not None:
            return self.found
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.found = i + 1
                    return self.found
        self.pos = len(text)
        return None


def json_end(text: str, start: int) -> int | None:
    """The index just after the JSON object or array opening at text[start], None while it is incomplete."""
    return _JsonScanner(start).end(text)


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of a marker."""
    held = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), held, -1):
            if text.endswith(m[:k]):
                held = k
                break
    return held


class ToolCallParser:
    """Content and calls of one output, fed as it streams; calls after the first `max_calls` are dropped."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt, self.max_calls = fmt, max_calls
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not decided yet
        self._state = "text"  # text, open (before mistral's '['), call (before an object), args, after
        self._run = ""  # the run's text consumed so far, from its marker: content if no call comes of it
        self._run_calls = 0  # calls the run has started
        # content or a call has come out (a run without its marker opens only at the start)
        self._started = False
        self._pending_ws = ""  # trailing content whitespace, held: it is dropped when a call follows
        self._strip_next = False  # whitespace right after a call is no content either
        self.cut = False  # the output ended inside a call

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The rest, once the output has ended: text still held is content, and a run of calls that has
        not started a call is content as written."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        self.cut = self.cut or self._state in ("open", "call", "args")
        if self._state != "text" and self._run_calls == 0:
            self._content(out, self._run + self._buf)
        elif self._state in ("text", "after"):
            self._content(out, self._buf)
        self._buf = ""
        if self._pending_ws and not self.calls:
            out.append(self._pending_ws)
        self._pending_ws = ""
        return out

    # ---- the state machine: each step consumes what it can decide; False when it must wait --------
    def _step(self, out: list[Delta], final: bool) -> bool:
        if self._state == "text":
            return self._in_text(out, final)
        if self._state == "args":
            return self._in_args(out)
        pos = len(self._buf) - len(self._buf.lstrip())
        if pos == len(self._buf):
            return False
        if self._state == "open":
            return self._expect(pos, self.fmt.open, "call", out, final)
        if self._state == "call":
            return self._in_call(out, pos, final)
        return self._after_call(out, pos, final)

    def _in_text(self, out: list[Delta], final: bool) -> bool:
        fmt = self.fmt
        if fmt.at_start and not self._started:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            marker = any(m.startswith(stripped[: len(m)]) for m in fmt.markers)
            if stripped.startswith(fmt.open or "{") and not marker:
                self._buf = stripped
                self._open_run("", "open" if fmt.open else "call")
                return True
        hits = [(i, m) for m in fmt.markers if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._content(out, self._buf[:i])
            self._buf = self._buf[i + len(marker) :]
            self._open_run(marker, "open" if fmt.open else "call")
            return True
        keep = 0 if final else _held_prefix(self._buf, fmt.markers)
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _open_run(self, marker: str, state: str) -> None:
        self._state, self._run, self._run_calls = state, marker, 0
        self._pending_ws = ""  # whitespace before a call is no content

    def _consume(self, n: int) -> None:
        self._run += self._buf[:n]
        self._buf = self._buf[n:]

    def _expect(self, pos: int, text: str, state: str, out: list[Delta], final: bool) -> bool:
        if self._buf.startswith(text, pos):
            self._consume(pos + len(text))
            self._state = state
            return True
        if text.startswith(self._buf[pos:]) and not final:
            return False
        return self._not_a_call(out, pos)

    def _not_a_call(self, out: list[Delta], upto: int) -> bool:
        """The run's text up to `upto` in the buffer is content; the rest is read again as text."""
        if self._run_calls == 0:
            self._content(out, self._run + self._buf[:upto])
        self._buf = self._buf[upto:]
        self._state, self._run = "text", ""
        self._started = True
        return True

    def _in_call(self, out: list[Delta], pos: int, final: bool) -> bool:
        if self._buf[pos] != "{":
            return self._not_a_call(out, pos)
        head = _NAME_FIRST.match(self._buf, pos)
        if head is not None and self._buf[head.end() : head.end() + 1] == "{":
            self._consume(pos)
            self._args_at = head.end() - pos
            self._args = _JsonScanner(self._args_at)
            self._start(out, ToolCall(call_id(), json.loads(head.group(1))))
            self._state = "args"
            return True
        end = json_end(self._buf, pos)
        if end is None:
            self.cut = final
            if final or not _may_become_call(self._buf[pos:]):
                return self._not_a_call(out, len(self._buf) if final else pos + 1)
            return False
        try:
            obj = json.loads(self._buf[pos:end])
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)):
            return self._not_a_call(out, end)
        call = ToolCall(call_id(), obj["name"], json.dumps(args, ensure_ascii=False), complete=True)
        self._start(out, call)
        self._emit(out, CallDelta(len(self.calls) - 1, arguments=call.arguments))
        self._consume(end)
        self._state = "after"
        return True

    def _start(self, out: list[Delta], call: ToolCall) -> None:
        self.calls.append(call)
        self._run_calls += 1
        self._emit(out, CallDelta(len(self.calls) - 1, call.id, call.name))

    def _in_args(self, out: list[Delta]) -> bool:
        call = self.calls[-1]
        end = self._args.end(self._buf)
        piece = self._buf[self._args_at + len(call.arguments) : len(self._buf) if end is None else end]
        if piece:
            call.arguments += piece
            self._emit(out, CallDelta(len(self.calls) - 1, arguments=piece))
        if end is None:
            return False
        # the arguments are whole: the call's object closes next (other keys after them are let be)
        obj_end = json_end(self._buf, 0)
        if obj_end is None:
            return False
        try:
            json.loads(call.arguments)
            call.complete = isinstance(json.loads(self._buf[:obj_end]), dict)
        except ValueError:
            call.complete = False
        self._consume(obj_end)
        self._state = "after"
        return True

    def _after_call(self, out: list[Delta], pos: int, final: bool) -> bool:
        """After a call object: the call's closing text, the next call of the run, or the run's end."""
        fmt = self.fmt
        ends = [t for t in (fmt.call_suffix.strip(), fmt.close.strip()) if t]
        sep = fmt.separator.strip()
        rest = self._buf[pos:]
        for text, state in [(t, "text") for t in ends] + ([(sep, "call")] if sep else []):
            if rest.startswith(text):
                self._consume(pos + len(text))
                self._state = state
                if state == "text":
                    self._strip_next, self._started = True, True
                return True
        if not final and any(t.startswith(rest) for t in [*ends, sep] if t):
            return False
        # no closing text: what follows the call is text
        self._state, self._strip_next = "text", True
        return True

    # ---- output --------------------------------------------------------------------------------
    def _emit(self, out: list[Delta], delta: CallDelta) -> None:
        self._started = True
        if self.max_calls is None or delta.index < self.max_calls:
            out.append(delta)

    def _content(self, out: list[Delta], text: str) -> None:
        if self._strip_next:
            text = text.lstrip()
            if not text:
                return
            self._strip_next = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        if body:
            self._started = True
            out.append(body)


def _may_become_call(text: str) -> bool:
    """Whether an unfinished object may still be a call: its first key is (a start of) name, arguments or
    parameters."""
    head = re.match(r'\{\s*(?:"((?:[^"\\]|\\.)*)("?))?', text)
    if head is None or head.group(1) is None:
        return True
    key, closed = head.group(1), head.group(2)
    keys = ("name", "arguments", "parameters")
    return key in keys if closed else any(k.startswith(key) for k in keys)


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(text: str, fmt: ToolFormat, max_calls: int | None = None) -> ParsedOutput:
    """A whole output's content and calls. An output cut inside a call, or arguments that are not a JSON
    object, leave the whole text as content: a client gets calls it can run, or none."""
    parser = ToolCallParser(fmt, max_calls)
    deltas = parser.feed(text) + parser.finish()
    calls = parser.calls[:max_calls] if max_calls is not None else parser.calls
    if parser.cut or not all(c.complete and isinstance(_loads(c.arguments), dict) for c in parser.calls):
        return ParsedOutput(text or None)
    content = "".join(d for d in deltas if isinstance(d, str))
    return ParsedOutput(content or None, calls)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
