"""A thinking model's reasoning split from its answer: `--reasoning-parser` (vLLM's and SGLang's flag).

Qwen3 and DeepSeek-R1 write their chain of thought between `<think>` and `</think>`, then the answer. With a
parser the chat completions answer with the thought in `reasoning_content` (SGLang's and DeepSeek's field,
vLLM's until it renamed it) and the answer alone in `content`, where tool calls are looked for.

Where the reasoning starts: the model may write `<think>` itself (Qwen3), or the chat template may end the
prompt inside an open `<think>` (DeepSeek-R1, Qwen3's thinking releases), so that only `</think>` comes out; a
prompt that closes the block itself (Qwen3 with `enable_thinking: false`) leaves the output all answer. The
tokenizer worker, which renders the prompt, says which (`prompt_opens`); DeepSeek-R1's parser takes the output
as reasoning until `</think>` whatever the prompt, as its early releases start thinking without the tag.

An output constrained by a grammar (response_format, a regex, forced tool calls) is held to it from its first
token, so it starts as the answer: it has reasoning only where the grammar itself writes the tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # the output begins inside the reasoning whatever the prompt says
    always_open: bool = False


FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", always_open=True),
}
# vLLM spells the names with an underscore
ALIASES = {"deepseek_r1": "deepseek-r1"}


def reasoning_format(name: str) -> ReasoningFormat:
    return FORMATS[ALIASES.get(name, name)]


def prompt_opens(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the output starts inside the reasoning: always for a format that says so, else where the prompt
    ends inside a reasoning block (its last opening tag not closed). `prompt` is the model's turn as the
    template opened it (Tokenization.turn_opening), not what clients wrote before."""
    return fmt.always_open or prompt.rfind(fmt.start) > prompt.rfind(fmt.end)


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag` (held until more comes)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """One output's reasoning and answer, fed as it streams: each call returns the new (reasoning, content).

    The reasoning is given without the whitespace around it, and the answer without the whitespace before
    it, in a stream as in a whole answer (whitespace is held until text follows it). With `stream=False`
    (SGLang's `stream_reasoning: false`) the reasoning comes out whole once it ends.
    """

    def __init__(self, fmt: ReasoningFormat, opened: bool, stream: bool = True) -> None:
        """`opened`: the output starts inside the reasoning (prompt_opens)."""
        self.fmt, self.stream = fmt, stream
        self.opened = opened
        # start: nothing decided yet (an opening tag may come); reasoning; after (its end tag, whitespace to
        # drop); content
        self._state = "start"
        self._buf = ""  # text not given out yet
        self._held = ""  # reasoning not given out yet (stream=False), or its trailing whitespace
        self._reasoned = False  # some reasoning has been given out

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The rest, once the output has ended (inside the reasoning, what is left is reasoning)."""
        return self._advance(final=True)

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        """feed(text), and finish() after it when the output has ended with it."""
        reasoning, content = self.feed(text)
        if finished:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            start = self.fmt.start
            if head.startswith(start):
                self._buf = head[len(start) :]
                self._state = "reasoning"
            elif not final and start.startswith(head):
                return "", ""  # whitespace or part of the tag so far
            else:
                self._state = "reasoning" if self.opened else "content"
        if self._state == "reasoning":
            reasoning, ended = self._in_reasoning(final)
            if not ended:
                return reasoning, ""
            self._state = "after"
        if self._state == "after":
            # the answer starts at its first text that is not whitespace
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def _in_reasoning(self, final: bool) -> tuple[str, bool]:
        """Reasoning text from the buffer, and whether its end tag has come (the buffer then holds what
        follows the tag)."""
        end = self.fmt.end
        at = self._buf.find(end)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(end) :]
            return self._give(text, closing=True), True
        keep = 0 if final else _held_prefix(self._buf, end)
        text = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return self._give(text, closing=final), False

    def _give(self, text: str, closing: bool) -> str:
        """The reasoning to give out now of `text` that follows what was held: none of its leading whitespace,
        and its trailing whitespace held (dropped where the reasoning ends)."""
        text = self._held + text
        if not self._reasoned:
            text = text.lstrip()
        if closing:
            self._held = ""
            text = text.rstrip()
        elif not self.stream:
            self._held, text = text, ""
        else:
            body = text.rstrip()
            self._held, text = text[len(body) :], body
        self._reasoned = self._reasoned or bool(text)
        return text


def tag_ids(tokenizer: Any, fmt: ReasoningFormat) -> tuple[int, int] | None:
    """The token ids of the format's opening and closing tags where each is one token of the vocabulary (as in
    every thinking model's), else None: the reasoning's tokens are then not counted."""
    ids = []
    for tag in (fmt.start, fmt.end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or tokenizer.decode(encoded) != tag:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


class ReasoningCount:
    """How many of an output's tokens are reasoning (OpenAI's usage.completion_tokens_details.reasoning_tokens),
    by the tags' token ids and the same rule as ReasoningParser: an opening tag as the first token, or an output
    that starts inside the reasoning, begins it; the closing tag ends it. The tags are not counted."""

    def __init__(self, tags: tuple[int, int], opened: bool) -> None:
        self.start, self.end = tags
        self.opened = opened
        self.state = "start"  # start, reasoning, content
        self.tokens = 0

    def add(self, token: int) -> None:
        if self.state == "start":
            if token == self.start:
                self.state = "reasoning"
                return
            self.state = "reasoning" if self.opened else "content"
        if self.state == "reasoning":
            if token == self.end:
                self.state = "content"
            else:
                self.tokens += 1
