"""/tokenize and /detokenize, answered by the tokenizer worker with the same tokenizer, chat template and
limits as the prompts of generation requests: the counts a client gets are the counts its requests use.

They run in the worker, not in the API server, so the server's event loop never waits on a tokenizer
(a body of megabytes takes the tokenizer a second or more), and the model's tokenizer is loaded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import RequestError
from minisgl.message.frontend import TokensMsg, TokensReply
from minisgl.tokenizer.tokenize import TokenizeManager

# what one step of a batch reads at most (at least one entry): characters of texts, or token ids; a step is
# a few milliseconds, so a batch of thousands takes turns with the other calls' prompts
STEP_ITEMS = 32 << 10


@dataclass
class TokensJob:
    """The reply to a TokensMsg, a few entries a step (TokenizerWorker gives each call a step in turn): a batch
    of thousands of texts would otherwise hold the worker, and every other call's prompt, for seconds. A text
    or chat the server would refuse as a prompt, or a token id outside the vocabulary, is an error reply."""

    manager: TokenizeManager
    msg: TokensMsg
    done: int = 0  # entries answered so far
    lists: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def step(self) -> TokensReply | None:
        """One step; the reply once the last entry is answered (or at the first error), else None."""
        msg = self.msg
        if msg.messages is not None:
            return answer_chat(self.manager, msg)  # one chat: bounded by the context length
        entries: list[str] | list[list[int]] = (
            msg.token_ids if msg.token_ids is not None else (msg.texts or [])
        )
        budget = STEP_ITEMS
        try:
            while self.done < len(entries):
                entry = entries[self.done]
                if isinstance(entry, str):
                    self.lists.append(self.manager.encode(entry, msg.add_special_tokens))
                else:
                    self.texts.append(_decode(self.manager, entry, msg.skip_special_tokens))
                self.done += 1
                budget -= len(entry)
                if budget <= 0:
                    break
        except RequestError as e:
            return TokensReply(msg.uid, error=str(e), error_code=e.code)
        if self.done < len(entries):
            return None
        if msg.token_ids is not None:
            return TokensReply(msg.uid, texts=self.texts)
        return _with_pieces(self.manager, msg, self.lists)


def answer_chat(manager: TokenizeManager, msg: TokensMsg) -> TokensReply:
    """The reply to a TokensMsg of a chat; one the server would refuse as a prompt is an error reply."""
    assert msg.messages is not None
    try:
        ids = manager.apply_chat_template(
            msg.messages,
            add_generation_prompt=msg.add_generation_prompt,
            template_kwargs=msg.chat_template_kwargs,
        )
    except RequestError as e:
        return TokensReply(msg.uid, error=str(e), error_code=e.code)
    return _with_pieces(manager, msg, [ids])


def _with_pieces(manager: TokenizeManager, msg: TokensMsg, lists: list[list[int]]) -> TokensReply:
    tokenizer = manager.tokenizer
    pieces = [list(tokenizer.convert_ids_to_tokens(ids)) for ids in lists] if msg.with_pieces else None
    return TokensReply(msg.uid, token_ids=lists, pieces=pieces)


def _decode(manager: TokenizeManager, ids: list[int], skip_special_tokens: bool) -> str:
    vocab = manager.limits.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary; each must be in [0, {vocab})",
            None,
            "invalid_token_ids",
        )
    return manager.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
