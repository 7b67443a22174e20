"""Prompts to token ids: plain text, token ids as given, or a chat rendered with the model's template."""

from __future__ import annotations

from typing import Any

from minisgl.message.frontend import TokenizeMsg
from minisgl.utils.hf import chat_template_ids


class PromptError(ValueError):
    """A prompt the model cannot take; `code` is the OpenAI error code the API server reports."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class TokenizeManager:
    def __init__(self, tokenizer: Any, max_seq_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """The prompt's token ids, checked against the context length; raises PromptError."""
        if msg.messages is not None:
            ids = self.apply_chat_template(msg.messages)
        elif msg.text is not None:
            ids = list(self.tokenizer.encode(msg.text))
        else:
            ids = list(msg.input_ids or [])
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise PromptError(
                    f"the prompt has token ids outside the vocabulary; each must be in [0, {self.vocab_size})",
                    "invalid_token_ids",
                )
        if not ids:
            raise PromptError("the prompt is empty; send at least one token", "empty_prompt")
        # the scheduler refuses these too; checking here answers before anything is queued
        if len(ids) >= self.max_seq_len:
            raise PromptError(
                f"the prompt has {len(ids)} tokens; this model takes at most {self.max_seq_len - 1} prompt "
                f"tokens (context length {self.max_seq_len}, one token left to generate). Shorten the prompt.",
                "context_length_exceeded",
            )
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                "no_chat_template",
            )
        try:
            return chat_template_ids(self.tokenizer, messages)
        except Exception as e:  # the template itself may refuse a conversation (e.g. roles out of order)
            raise PromptError(f"the chat template refused these messages: {e}", "invalid_messages") from e
