"""Prompts to token ids: plain text, token ids as given, or a chat rendered with the model's chat template.

One tokenizer process serves every client, so no prompt may hold it for long: a text far longer than
the context is refused from the tokens of its first pieces, before the whole is read, and the pieces
are counted one a step (`Tokenization`), so the worker polls its sockets between them: a body of
megabytes holds the requests behind it for milliseconds, not a second.
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.core import RequestError
from minisgl.message.frontend import TokenizeMsg
from minisgl.scheduler.check import RequestLimits, prompt_too_long
from minisgl.tokenizer.template_kwargs import TemplateKwargsCheck
from minisgl.utils.hf import chat_pieces_ids, render_chat

# a text is tokenized whole up to this many characters per token of context (real text has 3 to 5)
_CHARS_PER_TOKEN = 8
# tokens a cut through the middle of a word may add to a piece's count, with room to spare
_CUT_SLACK = 16
# the most characters counted in one step (15-25 ms of a fast tokenizer on one core)
_PIECE_CHARS = 32 << 10
# the error code of a text too long to tokenize whole for truncate_prompt_tokens (the API names that field by it)
TRUNCATE_CODE = "prompt_too_long_to_truncate"
# the error code of documents for a template that does not write them
DOCUMENTS_CODE = "documents_not_in_template"


class TokenizeManager:
    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.check_template_kwargs = TemplateKwargsCheck(tokenizer)

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        """The prompt's token ids (checked by check_request afterwards); a chat the template refuses, or a
        prompt certainly over the context length, raises RequestError."""
        job = Tokenization(self, msg)
        while (ids := job.step()) is None:
            pass
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain text's token ids; a text certainly over the context length raises RequestError."""
        LengthProof(self, text).run()
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        pieces = self.render(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        LengthProof(self, "".join(p for p, _ in pieces)).run()
        return chat_pieces_ids(self.tokenizer, pieces)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        truncated: bool = False,
        documents: list[dict[str, str]] | None = None,
    ) -> list[tuple[str, bool]]:
        """The conversation in the chat template as render_chat's pieces; a conversation the template
        refuses, one of more messages than the context has tokens (unless the prompt is `truncated` to its
        last tokens), or template_kwargs the template does not take (template_kwargs.py) raise RequestError."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
                None,
                "no_chat_template",
            )
        if len(messages) >= self.limits.max_seq_len and not truncated:
            # every message the template writes is at least one token
            raise prompt_too_long(len(messages) - 1, self.limits.max_seq_len, at_least=True)
        self._refuse_control_text(messages, tools)
        if template_kwargs:
            self.check_template_kwargs(template_kwargs)
        if documents and not self.check_template_kwargs.reads_documents:
            raise RequestError(
                "this model's chat template does not write documents; put them into a message instead",
                "documents",
                DOCUMENTS_CODE,
            )
        try:
            pieces = render_chat(
                self.tokenizer,
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
                documents=documents,
            )
        except Exception as e:  # the template itself may refuse a conversation (e.g. roles out of order)
            raise RequestError(
                f"the chat template refused these messages: {e}", None, "invalid_messages"
            ) from e
        return pieces

    def _refuse_control_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """Tools and earlier calls are written by the template as its own text, where a control token spelled
        in them would be read as one (contents are guarded by render_chat): such a request is refused."""
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if not tools and not calls:
            return
        text = json.dumps([tools, calls], ensure_ascii=False)
        for token in self.check_template_kwargs.controls:
            if token in text:
                raise RequestError(
                    f"the tools or tool calls spell the control token {token!r}; remove it",
                    None,
                    "invalid_messages",
                )


class LengthProof:
    """Whether a text is certainly longer than the context, found a piece of it a step.

    Only a text of more than _CHARS_PER_TOKEN characters a token of context is counted. Its pieces are
    tokenized each on its own, in order, until their tokens, less _CUT_SLACK a cut, pass what the model
    takes (RequestError) or the text ends (it may fit, and is tokenized whole by the caller). The work is
    what the proof needs and no more, and no step is longer than one piece.
    """

    def __init__(self, manager: TokenizeManager, text: str, truncate: int | None = None) -> None:
        """`truncate`: only the text's last tokens are kept, so its length is no error; it is then tokenized whole
        in one step, which a text of more characters than a proof would count whole takes too long for
        (RequestError)."""
        self.tokenizer, self.text = manager.tokenizer, text
        self.max_seq_len = manager.limits.max_seq_len
        size = _CHARS_PER_TOKEN * self.max_seq_len
        if truncate is not None and len(text) > size:
            raise RequestError(
                f"the prompt has {len(text):,} characters, more than the {size:,} that truncate_prompt_tokens "
                f"takes on this server ({_CHARS_PER_TOKEN} a token of its context of {self.max_seq_len:,}); "
                "send the end of the text, or its token ids",
                "truncate_prompt_tokens",
                TRUNCATE_CODE,
            )
        self.at = len(text) if len(text) <= size else 0  # a text this short needs no proof
        self.piece = min(size, _PIECE_CHARS)
        self.count = self.cuts = 0

    def step(self) -> bool:
        """Count the next piece; True once the text is not proven too long and nothing is left to count."""
        if self.at >= len(self.text):
            return True
        piece = self.text[self.at : self.at + self.piece]
        self.at += len(piece)
        self.count += len(self.tokenizer.encode(piece, add_special_tokens=False))
        self.cuts += 1
        least = self.count - _CUT_SLACK * self.cuts  # no fewer tokens can the whole text have so far
        if least > self.max_seq_len - 1:
            raise prompt_too_long(least, self.max_seq_len, at_least=True)
        return False

    def run(self) -> None:
        """Every step at once (where nothing waits behind the text)."""
        while not self.step():
            pass


class Tokenization:
    """One prompt's way to token ids in steps of bounded time, so the worker polls its sockets between
    them: a chat is rendered in the first step, a long text counted a piece a step (LengthProof), and the
    whole tokenized in the last, whose step() returns the ids (None before)."""

    def __init__(self, manager: TokenizeManager, msg: TokenizeMsg) -> None:
        self.manager, self.msg = manager, msg
        self._pieces: list[tuple[str, bool]] | None = None
        self._proof: LengthProof | None = None

    @property
    def turn_opening(self) -> str | None:
        """A chat's prompt from where the model's own turn starts, as the template wrote it: after the last text
        a client sent, or from it when that text is the message being continued (None for other prompts, or
        before the first step). What clients wrote before it (a user quoting a tag, say) is left out."""
        if self._pieces is None:
            return None
        last = max((k for k, (_, client) in enumerate(self._pieces) if client), default=-1)
        start = last if self.msg.continue_final_message and last >= 0 else last + 1
        return "".join(p for p, _ in self._pieces[start:])

    def step(self) -> list[int] | None:
        msg, manager = self.msg, self.manager
        if msg.messages is None and msg.text is None:
            return self._truncated(list(msg.input_ids or []))
        truncate = msg.truncate_prompt_tokens
        if self._proof is None:
            if msg.messages is not None:
                self._pieces = manager.render(
                    msg.messages,
                    msg.tools,
                    msg.add_generation_prompt,
                    msg.continue_final_message,
                    msg.chat_template_kwargs,
                    truncated=truncate is not None,
                    documents=msg.documents,
                )
                self._proof = LengthProof(manager, "".join(p for p, _ in self._pieces), truncate)
                return None
            self._proof = LengthProof(manager, msg.text or "", truncate)
        if not self._proof.step():
            return None
        if self._pieces is not None:
            return self._truncated(chat_pieces_ids(manager.tokenizer, self._pieces))
        return self._truncated(
            list(manager.tokenizer.encode(msg.text, add_special_tokens=msg.add_special_tokens))
        )

    def _truncated(self, ids: list[int]) -> list[int]:
        """The prompt's last msg.truncate_prompt_tokens tokens (vLLM's left truncation), or all of them."""
        keep = self.msg.truncate_prompt_tokens
        return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep :]

    @property
    def truncated(self) -> bool:
        """Whether the prompt may have lost tokens to truncate_prompt_tokens (its text is then not the ids')."""
        return self.msg.truncate_prompt_tokens is not None
