"""/tokenize and /detokenize, answered by the tokenizer worker with the same tokenizer, chat template and
limits as the prompts of generation requests: the counts a client gets are the counts its requests use.

They run in the worker, not in the API server, so the server's event loop never waits on a tokenizer
(a body of megabytes takes the tokenizer a second or more), and the model's tokenizer is loaded once.
"""

from __future__ import annotations

from minisgl.core import RequestError
from minisgl.message.frontend import TokensMsg, TokensReply
from minisgl.tokenizer.tokenize import TokenizeManager


def answer_tokens(manager: TokenizeManager, msg: TokensMsg) -> TokensReply:
    """The reply to a TokensMsg; a text or chat the server would refuse as a prompt, or a token id outside
    the vocabulary, is an error reply naming the field."""
    tokenizer = manager.tokenizer
    try:
        if msg.token_ids is not None:
            texts = [_decode(manager, ids, msg.skip_special_tokens) for ids in msg.token_ids]
            return TokensReply(msg.uid, texts=texts)
        if msg.messages is not None:
            lists = [
                manager.apply_chat_template(msg.messages, add_generation_prompt=msg.add_generation_prompt)
            ]
        else:
            lists = [manager.encode(text, msg.add_special_tokens) for text in msg.texts or []]
    except RequestError as e:
        return TokensReply(msg.uid, error=str(e), error_code=e.code)
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
