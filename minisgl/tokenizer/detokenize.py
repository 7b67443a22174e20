"""IncrementalDetokenizer: a request's output tokens as a stream of text pieces.

Decoding token by token goes wrong in two ways: a token may end in the middle of a UTF-8
character (it decodes to U+FFFD until the next token completes it), and some tokenizers drop
or add a leading space depending on what comes before. So each step decodes a short window
that starts one token back (the `prefix_offset`/`read_offset` pair, as in vLLM and TGI) and
keeps the new text back while it ends in U+FFFD. Stop strings are cut out of the text, as
OpenAI does (or kept, with vLLM's include_stop_str_in_output, and nothing after them); text that might be the start of one is held until it is known either way. Before
`min_tokens` tokens, stop strings are not looked for (vLLM's rule) and the text goes out at once: it is
never searched, so a stop string counts only when it starts after it.
`finish()` returns whatever is still held, so no text is lost at the end.

`step()` is the one place that turns the scheduler's token messages into a request's text and
decides stop strings, for the server's tokenizer worker and for the offline `LLM` alike. Without
stop strings and with `streaming` off (offline), the text is decoded once, at the end.
`step_batch()` takes a whole scheduler step at once: the windows of every request are decoded in
one call of the fast tokenizer (one Rust call instead of two Python calls per token), which is what
lets one worker keep up with hundreds of streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.message import DetokenizeMsg

_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizeStep:
    text: str  # new text to show
    output_token: int | None  # the message's token, if it is part of the output
    finished: bool
    finish_reason: str | None
    abort: bool  # a stop string ended the request before the scheduler knew: tell it to stop


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        streaming: bool = True,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        keep_stop: bool = False,
    ) -> None:
        """`keep_stop`: the stop string or stop token that ends the output stays in it (include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.keep_stop = keep_stop
        self.stop = [s for s in stop or [] if s]
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.lazy = not streaming and not self.stop
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window decoded each step starts here ...
        self.read_offset = 0  # ... and the text of tokens before this one has been taken already
        self.text = ""  # every complete character decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` returned so far
        self.searched = 0  # `text` before this has been searched for stop strings
        self.stopped = False  # a stop string was found: the output ends before it
        self.matched: str | None = None  # that stop string

    def step(self, msg: DetokenizeMsg) -> DetokenizeStep:
        """Take one message of the scheduler for this request."""
        return step_batch(self.tokenizer, [(self, msg)])[0]

    def take_plain(self, msg: DetokenizeMsg) -> bool:
        """Take a message that needs no decoding now, as `step()` would (True): a token that ends nothing, for a
        detokenizer that decodes at the end (offline, no stop strings). False: the message is for `step()`."""
        if not self.lazy or msg.finished or msg.next_token < 0:
            return False
        self.ids.append(msg.next_token)
        return True

    def add(self, token: int) -> str:
        """Take the next token; return the text that can be shown now (maybe empty)."""
        return self.step(DetokenizeMsg(-1, token, False)).text

    def finish(self) -> str:
        """The request has ended: return every character still held back."""
        self._decode_new(final=True)
        return self._release(final=True)

    def _output_token(self, msg: DetokenizeMsg) -> int | None:
        # the scheduler's "stop" means its last token is a stop token: it ends the output, unseen (as in OpenAI)
        # unless it is kept (its text then as skip_special_tokens has it: an EOS is a control token)
        if msg.next_token >= 0 and (self.keep_stop or not (msg.finished and msg.finish_reason == "stop")):
            return msg.next_token
        return None

    def _window(self) -> tuple[list[int], list[int]] | None:
        """The ids whose texts the next decode needs (the text before the new tokens, and with them)."""
        if self.stopped or self.read_offset == len(self.ids):
            return None
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def _take(self, prefix: str, full: str, final: bool) -> None:
        # an unfinished UTF-8 character decodes to U+FFFD; wait for the tokens that complete it
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _decode_new(self, final: bool) -> None:
        window = self._window()
        if window is not None:
            prefix, full = decode_all(self.tokenizer, list(window), self.skip_special_tokens)
            self._take(prefix, full, final)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        found = self._find_stop()
        if found is not None:
            end, self.matched = found
            self.stopped = True
            if self.keep_stop:
                end += len(self.matched)
            self.text = self.text[:end]
        else:
            self.searched = len(self.text)
            held = 0 if final or len(self.ids) < self.min_tokens else self._partial_stop_len()
            end = len(self.text) - held
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which one it is."""
        if not self.stop or len(self.ids) < self.min_tokens:
            return None
        # a stop string that starts before `searched` would have been found already, unless it ends after it
        # text already sent cannot be cut back (before min_tokens it is sent unsearched)
        start = max(self.sent, self.searched - max(len(s) for s in self.stop) + 1)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest end of `text` that a stop string starts with."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


def step_batch(
    tokenizer: Any, items: list[tuple[IncrementalDetokenizer, DetokenizeMsg]]
) -> list[DetokenizeStep]:
    """`step()` of many requests (each at most once), with one decode call for all of them.

    The same rules as one `step()` at a time, in the same order: take the token, decode the new
    window, release what is not held back, then on the last message flush what is left.
    """
    tokens: list[int | None] = []
    # the windows to decode and the items they are of, apart for the requests that keep control tokens
    windows: dict[bool, list[list[int]]] = {True: [], False: []}
    decoding: dict[bool, list[int]] = {True: [], False: []}
    for k, (det, msg) in enumerate(items):
        token = det._output_token(msg)
        tokens.append(token)
        if token is None:
            continue
        det.ids.append(token)
        window = None if det.lazy else det._window()
        if window is not None:
            windows[det.skip_special_tokens] += window
            decoding[det.skip_special_tokens].append(k)
    for skip, seqs in windows.items():
        texts = decode_all(tokenizer, seqs, skip)
        for j, k in enumerate(decoding[skip]):
            items[k][0]._take(texts[2 * j], texts[2 * j + 1], final=False)
    texts_out: list[str] = []
    ending: dict[bool, list[int]] = {True: [], False: []}
    for k, ((det, msg), token) in enumerate(zip(items, tokens)):
        texts_out.append(det._release(final=False) if token is not None and not det.lazy else "")
        if msg.finished or det.stopped:
            ending[det.skip_special_tokens].append(k)
    # the ending requests' last windows in one decode call too (a lazy detokenizer's whole output): a burst of
    # short requests ends together, and a call a request cost the offline replies a decode each
    for skip, ks in ending.items():
        windows = [(k, w) for k in ks if (w := items[k][0]._window()) is not None]
        texts = decode_all(tokenizer, [seq for _, w in windows for seq in w], skip)
        for j, (k, _) in enumerate(windows):
            items[k][0]._take(texts[2 * j], texts[2 * j + 1], final=True)
    out = []
    for (det, msg), token, text in zip(items, tokens, texts_out):
        finished, reason = msg.finished or det.stopped, "stop" if det.stopped else msg.finish_reason
        if finished:
            text += det._release(final=True)
        out.append(DetokenizeStep(text, token, finished, reason, det.stopped and not msg.finished))
    return out


def decode_all(tokenizer: Any, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """The text of each sequence as `tokenizer.decode` gives it, special tokens left out unless asked for.

    A fast tokenizer that does no clean-up of spaces after decoding is asked once for all of them
    (its Rust `decode_batch`); any other one sequence at a time.
    """
    if not seqs:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]
