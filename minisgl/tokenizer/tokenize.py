"""Prompts to token ids: plain text, token ids as given, or a chat rendered with the model's chat template.

One tokenizer process serves every client, so no prompt may hold it for long: a text far longer than
the context is refused from the tokens of a prefix of it, before the whole is read (a body of
megabytes costs milliseconds, not seconds, and the requests behind it do not wait).
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.core import RequestError
from minisgl.message.frontend import TokenizeMsg
from minisgl.scheduler.check import RequestLimits, prompt_too_long
from minisgl.utils.hf import chat_pieces_ids, render_chat

# a text is tokenized whole up to this many characters per token of context (real text has 3 to 5)
_CHARS_PER_TOKEN = 8
# tokens a cut through the middle of a word may add to a prefix's count, with room to spare
_CUT_SLACK = 16


class TokenizeManager:
    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._controls: list[str] | None = None

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """The prompt's token ids (checked by check_request afterwards); a chat the template refuses, or a
        prompt certainly over the context length, raises RequestError."""
        if msg.messages is not None:
            return self.apply_chat_template(
                msg.messages, msg.tools, msg.add_generation_prompt, msg.continue_final_message
            )
        if msg.text is not None:
            return self.encode(msg.text)
        return list(msg.input_ids or [])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain text's token ids; a text certainly over the context length raises RequestError."""
        self._refuse_if_far_too_long(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                None,
                "no_chat_template",
            )
        if len(messages) >= self.limits.max_seq_len:
            # every message the template writes is at least one token
            raise prompt_too_long(len(messages) - 1, self.limits.max_seq_len, at_least=True)
        self._refuse_control_text(messages, tools)
        try:
            pieces = render_chat(
                self.tokenizer,
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        except Exception as e:  # the template itself may refuse a conversation (e.g. roles out of order)
            raise RequestError(
                f"the chat template refused these messages: {e}", None, "invalid_messages"
            ) from e
        self._refuse_if_far_too_long("".join(p for p, _ in pieces))
        return chat_pieces_ids(self.tokenizer, pieces)

    def _refuse_control_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """Tools and earlier calls are written by the template as its own text, where a control token spelled
        in them would be read as one (contents are guarded by render_chat): such a request is refused."""
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if not tools and not calls:
            return
        text = json.dumps([tools, calls], ensure_ascii=False)
        for token in self._control_texts():
            if token in text:
                raise RequestError(
                    f"the tools or tool calls spell the control token {token!r}; remove it",
                    None,
                    "invalid_messages",
                )

    def _control_texts(self) -> list[str]:
        if self._controls is None:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._controls = [t.content for t in decoder.values() if t.special and t.content]
        return self._controls

    def _refuse_if_far_too_long(self, text: str) -> None:
        """Raise the context-length error if a prefix of `text` alone has more tokens than the model takes.

        The prefix grows fourfold until it proves the text too long or reaches the end of it, so the work
        is bounded by what the proof needs. A text that fits is then tokenized whole, by the caller.
        """
        limit = self.limits.max_seq_len - 1
        size = _CHARS_PER_TOKEN * self.limits.max_seq_len
        while size < len(text):
            count = len(self.tokenizer.encode(text[:size], add_special_tokens=False))
            if count - _CUT_SLACK > limit:
                raise prompt_too_long(count - _CUT_SLACK, self.limits.max_seq_len, at_least=True)
            size *= 4
