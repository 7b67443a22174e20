"""Prompts to token ids: plain text, token ids as given, or a chat rendered with the model's template."""

from __future__ import annotations

from typing import Any

from minisgl.core import RequestError
from minisgl.message.frontend import TokenizeMsg
from minisgl.utils.hf import chat_template_ids


class TokenizeManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """The prompt's token ids (checked by check_request afterwards); a chat the template refuses raises RequestError."""
        if msg.messages is not None:
            return self.apply_chat_template(msg.messages)
        if msg.text is not None:
            return list(self.tokenizer.encode(msg.text))
        return list(msg.input_ids or [])

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                None,
                "no_chat_template",
            )
        try:
            return chat_template_ids(self.tokenizer, messages)
        except Exception as e:  # the template itself may refuse a conversation (e.g. roles out of order)
            raise RequestError(
                f"the chat template refused these messages: {e}", None, "invalid_messages"
            ) from e
