"""SamplingParams: how one request is sampled and when it stops, and the errors of a request minisgl
will not run. No torch here: the command line reads these fields to build its help."""

from __future__ import annotations

import json
import math
import random
import reprlib
from dataclasses import dataclass, field, replace
from typing import Any

# Integers cross process boundaries as msgpack, which carries 64 bits: signed ones, and unsigned seeds.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SEED_RANGE = (INT64_MIN, (1 << 64) - 1)
# Stop strings are searched in every request's text after every token, by the one detokenizer every
# request shares: their number and length are bounded so that no request can slow the others down.
MAX_STOP_STRINGS, MAX_STOP_LEN = 32, 256
MAX_STOP_TOKEN_IDS = 1024  # looked up after every token
# allowed_token_ids become a bitmask row once per request: any vocabulary fits (the largest have ~260k tokens)
MAX_ALLOWED_TOKEN_IDS = 1 << 20
# bad_words are matched against the end of every step's output of their request: bounded like stop strings
MAX_BAD_WORDS = 128
# logit_bias is a sparse add over the vocabulary inside the batch: its size per request is bounded so that
# one request cannot make every step of the others slower; the bias range is OpenAI's
MAX_LOGIT_BIAS, LOGIT_BIAS_RANGE = 1024, (-100.0, 100.0)
MAX_N = 128  # completions of one prompt
# A temperature below this is greedy (vLLM's rule): dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5


class RequestError(ValueError):
    """A request minisgl will not run, with what to change; `param` names the field at fault, `code`
    is the OpenAI-style error code the API server reports."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


class InvalidParam(RequestError):
    """A sampling parameter out of its range; `named(alias)` is the same error under an API's name for it."""

    def __init__(self, param: str, value: Any, want: str) -> None:
        # reprlib keeps a hostile value (a 1000-digit integer, a list of a million ids) out of the message
        super().__init__(f"{param}={reprlib.repr(value)} is invalid: {want}", param)
        self.value, self.want = value, want

    def named(self, alias: str) -> InvalidParam:
        return InvalidParam(alias, self.value, self.want)


def _param(default: Any, help: str) -> Any:
    # the help text is the one description of a field: the CLI and the API models are built from it
    if isinstance(default, (list, dict)):
        return field(default_factory=type(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# the fields that constrain the output to a grammar: at most one per request
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. Defaults follow the OpenAI API (temperature 0 is greedy)."""

    max_tokens: int = _param(1024, "most tokens to generate (cut to what the context length leaves)")
    temperature: float = _param(0.0, "softmax temperature; 0 (or anything below 1e-5) is greedy")
    top_k: int = _param(-1, "sample among the k most likely tokens; -1 or 0 turns it off")
    top_p: float = _param(1.0, "sample from the smallest set of tokens whose probability reaches p")
    min_p: float = _param(0.0, "drop tokens less likely than min_p times the most likely one")
    seed: int | None = _param(None, "seed of the sampling noise: the same seed gives the same tokens")
    ignore_eos: bool = _param(False, "keep generating after an end-of-sequence token")
    stop: list[str] = _param([], "strings that end the output (not included in it)")
    stop_token_ids: list[int] = _param([], "token ids that end the output (not included in it)")
    min_tokens: int = _param(0, "generate at least this many tokens: EOS, stop ids and stop strings wait")
    include_stop_str_in_output: bool = _param(
        False,
        "keep the stop string or stop token that ended the output in its text (vLLM's; SGLang's no_stop_trim)",
    )
    logit_bias: dict[int, float] = _param({}, "token id -> bias in [-100, 100] added to its logit")
    presence_penalty: float = _param(0.0, "subtracted once from the logit of every generated token")
    frequency_penalty: float = _param(0.0, "subtracted per occurrence from the logit of generated tokens")
    repetition_penalty: float = _param(1.0, "divides the logits of every token seen so far; 1 turns it off")
    logprobs: int | None = _param(None, "top log-probabilities per token (0: the chosen one); None: off")
    prompt_logprobs: int | None = _param(
        None, "log-probabilities of the prompt's tokens, with this many top ones (computes the whole prompt)"
    )
    json_schema: str | None = _param(None, "the output is JSON that this JSON schema (a string) accepts")
    regex: str | None = _param(None, "the output matches this regular expression")
    ebnf: str | None = _param(None, "the output is a sentence of this EBNF grammar (root rule: root)")
    skip_special_tokens: bool = _param(True, "leave control tokens (<|im_end|> and the like) out of the text")
    allowed_token_ids: list[int] | None = _param(
        None, "sample only among these token ids (vLLM's); EOS ends the output only if it is one of them"
    )
    bad_words: list[str] = _param(
        [], "words the output never contains (vLLM's): each as written alone and after a space, as tokens"
    )
    n: int = _param(
        1,
        "completions of each prompt, offline (vLLM's and SGLang's n): a prompt's completions in a row, completion "
        "i seeded seed + i where there is a seed; the APIs take n as their own field",
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)

    def validate(self) -> None:
        """Raise InvalidParam naming the parameter and the range it must be in."""

        def bad(name: str, want: str) -> InvalidParam:
            return InvalidParam(name, getattr(self, name), want)

        def is_int(x: object, low: int, high: int = INT64_MAX) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high

        def is_finite(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n, 1, MAX_N):
            raise bad("n", f"it must be an integer in [1, {MAX_N}]")
        if not is_int(self.max_tokens, 1):
            raise bad("max_tokens", "it must be an integer in [1, 2**63 - 1]")
        if not (is_finite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "it must be >= 0 and finite (0 means greedy)")
        if not is_int(self.top_k, -1):
            raise bad("top_k", "it must be an integer in [1, 2**63 - 1], or -1 / 0 to turn it off")
        if not (is_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise bad("top_p", "it must be in (0, 1]")
        if not (is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "it must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed, *SEED_RANGE):
            raise bad("seed", "it must be an integer in [-2**63, 2**64 - 1], or None")
        if not (is_finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", "it must be in [-2, 2]")
        if not (is_finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", "it must be in [-2, 2]")
        if not (is_finite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "it must be > 0 and finite (1 turns it off)")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN for s in self.stop
        ):
            raise bad(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, each of 1 to {MAX_STOP_LEN} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
            not is_int(t, 0) for t in self.stop_token_ids
        ):
            raise bad(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids, each an integer in [0, 2**63 - 1]",
            )
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
            or not all(is_int(t, 0) for t in self.allowed_token_ids)
        ):
            raise bad(
                "allowed_token_ids",
                f"it must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0), or None",
            )
        if len(self.bad_words) > MAX_BAD_WORDS or any(
            not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_LEN or not w.strip() for w in self.bad_words
        ):
            raise bad(
                "bad_words",
                f"at most {MAX_BAD_WORDS} words, each of 1 to {MAX_STOP_LEN} characters, not all of them spaces",
            )
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "it must be true or false")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "it must be true or false")
        if self.logprobs is not None and not is_int(self.logprobs, 0, 20):
            raise bad("logprobs", "it must be an integer in [0, 20], or None to turn it off")
        if self.prompt_logprobs is not None and not is_int(self.prompt_logprobs, 0, 20):
            raise bad("prompt_logprobs", "it must be an integer in [0, 20], or None to turn it off")
        if not is_int(self.min_tokens, 0) or self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "it must be an integer in [0, max_tokens]")
        low, high = LOGIT_BIAS_RANGE
        if (
            not isinstance(self.logit_bias, dict)
            or len(self.logit_bias) > MAX_LOGIT_BIAS
            or not all(is_int(t, 0) and is_finite(b) and low <= b <= high for t, b in self.logit_bias.items())
        ):
            raise bad(
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} token ids (integers >= 0), each with a bias in [{low:g}, {high:g}]",
            )
        constraints = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in constraints:
            if not isinstance(getattr(self, name), str):
                raise bad(name, "it must be a string")
        if len(constraints) > 1:
            raise bad(
                constraints[1], f"only one of {', '.join(GRAMMAR_FIELDS)} may be set; {constraints[0]} is"
            )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the output constraint, or None for free text."""
        return next(((n, getattr(self, n)) for n in GRAMMAR_FIELDS if getattr(self, n) is not None), None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def resolved_seed(self) -> int:
        """The seed a request samples with: the user's, or a fresh random one."""
        return random.getrandbits(62) if self.seed is None else fold_seed(self.seed)


def fold_seed(seed: int) -> int:
    """Any integer as a seed: the sampler hashes it as a signed 64-bit integer, so it is folded into that range."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so the choices differ reproducibly
    (folded into 64 bits as the sampler folds every seed, so the last seeds wrap instead of overflowing)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed if i == 0 else fold_seed(params.seed + i)) for i in range(n)]
