"""Structured output: a grammar matcher per constrained request and the next-token masks of a batch.

xgrammar compiles a request's JSON schema, regex or EBNF grammar against the tokenizer, on a thread
beside the scheduler's loop (compiled grammars are cached, so a schema shared by many requests
compiles once), and keeps one matcher per request. Each step, after the scheduler has the sampled tokens, every matcher advances by its
request's token; before the next step, one call fills the bitmask of allowed tokens for every
constrained row, and the sampler applies it on the device (`apply_token_mask`).

JSON is generated without free whitespace (one space after ':' and ','): a model that may emit any
whitespace can loop on newlines until max_tokens and never close the object.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch

from minisgl.constrained.bad_words import BadWords, word_sequences
from minisgl.constrained.bits import token_bits
from minisgl.core import ChunkedReq
from minisgl.params import RequestError, SamplingParams
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

_INSTALL = "structured output needs xgrammar: pip install 'minisgl[grammar]'"
# the longest schema, regex or EBNF text taken: compile time grows faster than the text (on the default
# model's tokenizer, a 23 KB schema compiles in about 60 ms, a 95 KB one in 1.3 s), and a request must
# not hold the scheduler's compile thread for seconds
MAX_GRAMMAR_CHARS = 32 * 1024


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise RequestError(f"{_INSTALL} ({e})", None, "unsupported_parameter") from e
    return xgrammar


def _message(e: Exception) -> str:
    # xgrammar prefixes its messages with a time and a source location: the user needs neither
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e).strip())


def _schema(text: str) -> str:
    """The JSON schema as xgrammar should get it.

    xgrammar (0.2.9) turns a string with minLength / maxLength into characters that exclude only
    the quote, the backslash and line breaks: other control characters get through raw and the JSON
    does not parse. Such a string becomes the same length range of characters that need no escape.
    """
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # xgrammar's own error says what is wrong

    def fix(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                fix(x)
        elif isinstance(node, dict):
            for x in node.values():
                fix(x)
            lengths = ("minLength" in node, "maxLength" in node)
            plain = not any(k in node for k in ("pattern", "format", "enum", "const"))
            if node.get("type") == "string" and any(lengths) and plain:
                low, high = node.pop("minLength", 0), node.pop("maxLength", "")
                node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'

    fix(schema)
    return json.dumps(schema)


@lru_cache(maxsize=256)
def _parse(kind: str, text: str) -> None:
    xgr = _xgrammar()
    if kind == "json_schema":
        xgr.Grammar.from_json_schema(_schema(text), any_whitespace=False)
    elif kind == "regex":
        xgr.Grammar.from_regex(text)
    else:
        xgr.Grammar.from_ebnf(text)


def check_grammar(params: SamplingParams, names: dict[str, str] | None = None) -> None:
    """Raise RequestError naming the field when the request's grammar does not compile (no tokenizer needed);
    `names` gives the name a request body used for a field, for the message."""
    grammar = params.grammar
    if grammar is None:
        return
    kind, text = grammar
    name = (names or {}).get(kind, kind)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(
            f"{name} has {len(text)} characters; this server takes at most {MAX_GRAMMAR_CHARS}",
            kind,
            "invalid_value",
        )
    try:
        _parse(kind, text)
    except RequestError:
        raise
    except Exception as e:
        raise RequestError(f"{name} does not compile: {_message(e)}", kind, "invalid_value") from e


def escape_regex(text: str) -> str:
    """`text` as a regex that matches exactly it (xgrammar's syntax: no escapes for plain characters)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


def choice_regex(choices: list[str]) -> str:
    """A regex accepting exactly one of `choices` (vLLM's guided_choice)."""
    return "(" + "|".join(escape_regex(c) for c in choices) + ")"


class GrammarManager:
    """The matchers of the scheduler's constrained requests, by uid; built on the first constrained request.

    A grammar compiles on a thread of its own from the moment its request arrives (xgrammar lets go of
    the GIL while it compiles), so the scheduler's steps go on meanwhile; the matcher is taken when the
    request first needs a mask, by which time it has usually waited in the queue longer than its
    compile. Every rank waits at that same point of the same batch, so the ranks' schedules stay equal.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], pin_memory: bool = False
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        # masks filled in pinned memory reach a GPU by an asynchronous copy
        self.pin_memory = pin_memory
        self.matchers: dict[int, Any] = {}
        # vLLM's allowed_token_ids: a fixed bitmask row a request, applied beside (or without) a grammar's
        self.allowed: dict[int, torch.Tensor] = {}
        # vLLM's bad_words: the sequences a request bans, its bans a row each step
        self.bad_words: dict[int, BadWords] = {}
        self._valid: torch.Tensor | None = None  # the row allowing every token of the vocabulary
        self._compiling: dict[int, Future[Any]] = {}
        # one thread: compiles run in arrival order, and the compiler's cache is touched by one at a time
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minisgl-grammar")
        self._compiler: Any = None
        self._batch: Any = None

    @property
    def active(self) -> bool:
        """Some request is constrained."""
        return bool(self.matchers) or bool(self._compiling) or bool(self.allowed) or bool(self.bad_words)

    def constrains(self, reqs: list[Any]) -> bool:
        """Some request of `reqs` is constrained, so the batch's masks need every token sampled before it
        (never waits for a compile: the answer is the same before and after it)."""
        if not self.active:  # most steps: no request is constrained, and no row need be looked at
            return False
        return any(
            r.uid in self.matchers
            or r.uid in self._compiling
            or r.uid in self.allowed
            or r.uid in self.bad_words
            for r in reqs
        )

    def add(self, uid: int, params: SamplingParams) -> None:
        """Start compiling the request's grammar (cached) on the compile thread; its matcher is taken later.
        Its allowed_token_ids become its bitmask row now, its bad_words token sequences."""
        grammar = params.grammar
        if grammar is not None:
            _xgrammar()  # RequestError now, not on the thread, when xgrammar is missing
        banned = None
        if params.bad_words:
            banned = BadWords(
                word_sequences(self.tokenizer, params.bad_words, self.vocab_size), self.vocab_size
            )
            banned.check_allowed(params.allowed_token_ids)
        # nothing is kept for a request refused above
        if banned is not None:
            self.bad_words[uid] = banned
        if params.allowed_token_ids is not None:
            self.allowed[uid] = token_bits(params.allowed_token_ids, self.vocab_size)
        if grammar is not None:
            self._compiling[uid] = self._pool.submit(self._compile, *grammar)

    def _compile(self, kind: str, text: str) -> Any:
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
            self._batch = xgr.BatchGrammarMatcher()
        if kind == "json_schema":
            compiled = self._compiler.compile_json_schema(_schema(text), any_whitespace=False)
        elif kind == "regex":
            compiled = self._compiler.compile_regex(text)
        else:
            compiled = self._compiler.compile_grammar(text)
        return xgr.GrammarMatcher(compiled)

    def _matcher(self, uid: int) -> Any:
        """The request's matcher, waiting for its compile if it is still running (None: none, or it ended)."""
        future = self._compiling.pop(uid, None)
        if future is not None:
            try:
                self.matchers[uid] = future.result()
            except Exception as e:
                # check_grammar compiled it without the tokenizer already, so this is a bug: end it cleanly
                logger.error(
                    f"request {uid}: the grammar failed to compile: {_message(e)}; the output ends here"
                )
                self.matchers[uid] = None
        return self.matchers.get(uid)

    def close(self) -> None:
        """Stop the compile thread (compiles not started are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._compiling.clear()

    def remove(self, uid: int) -> None:
        self.matchers.pop(uid, None)
        self.allowed.pop(uid, None)
        self.bad_words.pop(uid, None)
        future = self._compiling.pop(uid, None)
        if future is not None:
            future.cancel()

    def accept(self, uid: int, token: int) -> None:
        """Advance the request's matcher by its sampled token."""
        matcher = self._matcher(uid)
        if matcher is not None and not matcher.accept_token(token):
            # the mask allowed only tokens the matcher accepts, so this is a bug: end the request cleanly
            logger.warning(f"request {uid}: the grammar refused token {token}; the output ends here")
            self.matchers[uid] = None

    def is_done(self, uid: int) -> bool:
        """The request's grammar has ended (its stop token accepted), or refused a token."""
        if uid not in self.matchers and uid not in self._compiling:
            return False
        matcher = self._matcher(uid)
        return matcher is None or matcher.is_terminated()

    def fill_masks(self, reqs: list[Any]) -> torch.Tensor | None:
        """The [B, ceil(V/32)] int32 bitmask (on the CPU) of the tokens each row may sample next, filled by one
        call for every constrained row; other rows allow everything. None when no row is constrained.

        A chunk of a prompt samples nothing, so its row needs no mask. That is asked of the request's
        kind, not of `can_decode`: under overlap the masks are filled after the step has been counted
        (`complete_one`), when a request sampling its last token can no longer decode.
        """
        sampling = [(i, r) for i, r in enumerate(reqs) if not isinstance(r, ChunkedReq)]
        rows = [(i, m) for i, r in sampling if (m := self._matcher(r.uid)) is not None]
        fixed = [(i, bits) for i, r in sampling if (bits := self.allowed.get(r.uid)) is not None]
        banning = [(i, r, b) for i, r in sampling if (b := self.bad_words.get(r.uid)) is not None]
        if not rows and not fixed and not banning:
            return None
        shape = (len(reqs), (self.vocab_size + 31) // 32)
        mask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.pin_memory)
        if rows:
            self._batch.batch_fill_next_token_bitmask(
                [m for _, m in rows], mask, indices=[i for i, _ in rows]
            )
        for i, bits in fixed:
            mask[i] &= bits  # with a grammar too: the tokens both allow
        if banning:
            self._ban(mask, banning, {i for i, _ in rows} | {i for i, _ in fixed})
        return mask

    def _ban(self, mask: torch.Tensor, banning: list[tuple[int, Any, BadWords]], narrowed: set[int]) -> None:
        """Clear each banning row's banned tokens. A row a grammar or allowed_token_ids has narrowed may be left
        with nothing to sample: that step takes the row as it was (the words' bans step aside for it, as a
        sampler cannot draw from no token). A row of the whole vocabulary keeps all but a few hundred tokens."""
        for i, req, banned in banning:
            row = mask[i]
            before = row.clone() if i in narrowed else None
            banned.apply(row, req.input_ids, req.prompt_len)
            if before is not None:
                if self._valid is None:
                    self._valid = token_bits(list(range(self.vocab_size)), self.vocab_size)
                if not bool((row & self._valid).any()):
                    logger.warning(
                        f"request {req.uid}: bad_words ban every token it may sample; not this step"
                    )
                    row.copy_(before)


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token whose bit is 0 in `mask` [B, ceil(V/32)] set to -inf."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask[:, :, None] >> bits) & 1).view(mask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def _literal(text: str) -> str:
    return json.dumps(text)  # EBNF string literals escape as JSON's do (the texts here are ASCII)


def repeated_json_ebnf(
    schema: str,
    before: str = "",
    after: str = "",
    open: str = "",
    close: str = "",
    separator: str | None = None,
) -> str:
    """EBNF of `open item close` where an item is `before JSON after`, the JSON accepted by `schema`; with a
    `separator`, one or more items separated by it. (Tool calls: a call's markers around its JSON object.)"""
    xgr = _xgrammar()
    parts = [xgr.Grammar.from_json_schema(_schema(schema), any_whitespace=False)]
    if before:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {_literal(before)}"))
    if after:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(after)}"))
    item = xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]
    lines = str(item).splitlines()
    # the item's own root becomes a rule of the sequence's root (xgrammar prints root first)
    head = next(i for i, line in enumerate(lines) if line.startswith("root ::= "))
    body = lines[head].removeprefix("root ::= ")
    seq = body if separator is None else f"{body} ({_literal(separator)} {body})*"
    ends = [_literal(t) for t in (open,) if t], [_literal(t) for t in (close,) if t]
    lines[head] = "root ::= (" + " ".join([*ends[0], seq, *ends[1]]) + ")"
    return "\n".join(lines)
