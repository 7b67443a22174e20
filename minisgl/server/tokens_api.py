"""/tokenize and /detokenize in the shapes vLLM and SGLang both serve (also under /v1/).

- tokenize: {model?, prompt: str | [str], add_special_tokens?, return_token_strs?} or vLLM's
  {model?, messages, add_generation_prompt?, return_token_strs?} -> {count, max_model_len, tokens}
  (and `token_strs`). A list of prompts (SGLang's batch form) answers lists: tokens[i], count[i].
- detokenize: {model?, tokens: [int] | [[int]], skip_special_tokens?} -> {prompt, text}: vLLM names
  the text `prompt`, SGLang `text`; both are sent, so a client of either reads its own. Control
  tokens are kept unless `skip_special_tokens` is true: vLLM keeps them (and has no such field);
  SGLang's field defaults to true, so its clients that rely on that default see them.

Unknown fields are refused (400 naming the field), not ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from minisgl.message.frontend import TokensMsg, TokensReply
from minisgl.params import INT64_MAX, INT64_MIN
from minisgl.server.protocol import (
    IDS,
    MAX_CALL_COMPLETIONS,
    TEXTS,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    longer_than_a_call,
    refuse_over_context,
)


class _Exact(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _refuse_long_batch(value: Any, param: str) -> Any:
    """`value` as it is, unless it is a batch of more entries than a completion call takes prompts: then an
    APIError, before its entries are read (the worker answers a batch a few entries a step, but its reply is
    built and sent whole)."""
    if longer_than_a_call(value):
        raise APIError(
            f"'{param}' is a batch of {len(value)}; a call takes at most {MAX_CALL_COMPLETIONS}: send the "
            "batch over several calls",
            param,
            "too_many_prompts",
        )
    return value


class TokenizeRequest(_Exact):
    model: str | None = None
    prompt: TEXTS | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_a_call_takes(cls, value: Any) -> Any:
        return _refuse_long_batch(value, "prompt")

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_context(cls, value: Any, info: ValidationInfo) -> Any:
        # a chat is answered only if it fits the context (as a prompt), so a longer one is refused unread
        return refuse_over_context(value, "messages", info, "messages")

    def to_msg(self) -> TokensMsg:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of 'prompt' and 'messages'", "prompt", "invalid_value")
        strs = bool(self.return_token_strs)
        if self.messages is not None:
            if self.add_special_tokens:
                # vLLM's default for a chat too: its special tokens are the template's own
                raise APIError(
                    "add_special_tokens applies to 'prompt'; a chat's special tokens come from its template",
                    "add_special_tokens",
                    "invalid_value",
                )
            messages = ChatCompletionRequest.model_construct(messages=self.messages).chat()
            generation = self.add_generation_prompt is not False
            return TokensMsg(
                0,
                messages=messages,
                add_generation_prompt=generation,
                chat_template_kwargs=self.chat_template_kwargs or None,
                with_pieces=strs,
            )
        for name in ("add_generation_prompt", "chat_template_kwargs"):
            if getattr(self, name) is not None:
                raise APIError(f"{name} applies to 'messages', not to 'prompt'", name, "invalid_value")
        texts = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt or [])
        if not texts:
            raise APIError(
                "prompt is an empty list; send a text or a list of texts", "prompt", "empty_prompt"
            )
        special = self.add_special_tokens is not False
        return TokensMsg(0, texts=texts, add_special_tokens=special, with_pieces=strs)

    def response(self, reply: TokensReply, max_model_len: int) -> dict[str, Any]:
        batch = isinstance(self.prompt, list)
        tokens: Any = reply.token_ids if batch else reply.token_ids[0]
        count: Any = [len(t) for t in reply.token_ids] if batch else len(reply.token_ids[0])
        out = {"tokens": tokens, "count": count, "max_model_len": max_model_len}
        if reply.pieces is not None:
            out["token_strs"] = reply.pieces if batch else reply.pieces[0]
        return out


class DetokenizeRequest(_Exact):
    model: str | None = None
    tokens: IDS
    skip_special_tokens: bool | None = None

    @field_validator("tokens", mode="before")
    @classmethod
    def _batch_a_call_takes(cls, value: Any) -> Any:
        return _refuse_long_batch(value, "tokens")

    def to_msg(self) -> TokensMsg:
        batch = bool(self.tokens) and isinstance(self.tokens[0], list)
        lists: list[list[int]] = self.tokens if batch else [self.tokens]  # type: ignore[list-item]
        # the vocabulary is checked by the worker; an id no message can carry is refused here
        if any(ids and (min(ids) < INT64_MIN or max(ids) > INT64_MAX) for ids in lists):
            raise APIError(
                "'tokens' has a token id wider than 64 bits; token ids index the vocabulary",
                "tokens",
                "invalid_token_ids",
            )
        return TokensMsg(0, token_ids=lists, skip_special_tokens=bool(self.skip_special_tokens))

    def response(self, reply: TokensReply) -> dict[str, Any]:
        batch = bool(self.tokens) and isinstance(self.tokens[0], list)
        text: Any = reply.texts if batch else reply.texts[0]
        return {"prompt": text, "text": text}
