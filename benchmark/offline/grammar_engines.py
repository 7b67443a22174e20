"""Grammar engines for structured output, measured on the default model's tokenizer (vocab 49152).

For each installed engine (xgrammar, llguidance, outlines-core) and each of three grammars (a JSON
schema, a regex, any JSON object): the compile time, then the per-token cost of computing the
next-token mask and advancing the matcher over a realistic accepted token sequence (the tokens of
a valid output), plus each engine's installed size and its required dependencies.
    python benchmark/offline/grammar_engines.py
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "member", "tags"],
    "additionalProperties": False,
}
SCHEMA_TEXT = (
    '{"name": "Ada Lovelace, the first programmer", "age": 36, "city": "London", "member": true, '
    '"tags": ["mathematics", "engines", "poetry"]}'
)
REGEX = r"(\d{3}-\d{3}-\d{4}|[A-Z][a-z]+ [A-Z][a-z]+), born (19|20)\d\d in [A-Z][a-z]+\."
REGEX_TEXT = "Grace Hopper, born 1906 in Manhattan."
OBJECT_TEXT = (
    '{"title": "Structured output", "items": [1, 2, 3], "nested": {"ok": true, "note": "a short '
    'sentence of free text"}, "score": 0.75}'
)
CASES = {"json_schema": SCHEMA_TEXT, "regex": REGEX_TEXT, "json_object": OBJECT_TEXT}


def installed(dist: str) -> tuple[float, list[str]]:
    """(MiB on disk, the dependencies it requires) of an installed distribution."""
    d = md.distribution(dist)
    size = sum(f.size or 0 for f in d.files or [])
    deps = [r.split(";")[0].strip() for r in d.requires or [] if "extra ==" not in r]
    return size / (1 << 20), deps


def byte_vocab(tokenizer: Any) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE), for engines that take the vocabulary as bytes."""
    # GPT-2's byte-to-character table: printable bytes stand for themselves, the others are shifted past 255
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    unbyte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    vocab: dict[bytes, list[int]] = {}
    special = set(tokenizer.all_special_ids)
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        vocab.setdefault(bytes(unbyte[c] for c in token), []).append(i)
    return vocab


class Xgrammar:
    dist = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
        if kind == "regex":
            return c.compile_regex(REGEX)
        return c.compile_builtin_json_grammar()

    def matcher(self, grammar: Any) -> tuple[Callable[[], None], Callable[[int], bool]]:
        m = self.xgr.GrammarMatcher(grammar)
        return (lambda: m.fill_next_token_bitmask(self.mask, 0)), m.accept_token


class Llguidance:
    dist = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str) -> Any:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(json.dumps(SCHEMA))
        if kind == "regex":
            return M.grammar_from_regex(REGEX)
        return M.grammar_from_json_schema('{"type": "object"}')

    def matcher(self, grammar: Any) -> tuple[Callable[[], None], Callable[[int], bool]]:
        import llguidance.torch

        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return (lambda: llguidance.torch.fill_next_token_bitmask(m, self.mask, 0)), m.consume_token


class OutlinesCore:
    dist = "outlines_core"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import outlines_core as oc

        self.oc = oc
        self.vocab = oc.Vocabulary(tokenizer.eos_token_id, byte_vocab(tokenizer))
        self.mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json_schema":
            regex = build_regex_from_schema(json.dumps(SCHEMA))
        elif kind == "regex":
            regex = REGEX
        else:
            # outlines-core has no grammar for "any JSON": the nearest is a schema-less object
            regex = build_regex_from_schema('{"type": "object"}')
        return self.oc.Index(regex, self.vocab)

    def matcher(self, grammar: Any) -> tuple[Callable[[], None], Callable[[int], bool]]:
        g = self.oc.Guide(grammar)
        mask = self.mask

        def advance(t: int) -> bool:
            g.advance(t)
            return True

        return (lambda: g.write_mask_into(mask.data_ptr(), mask.numel(), 4)), advance


def measure(engine: Any, kind: str, tokens: list[int], repeat: int) -> tuple[float, float, float, float]:
    """(compile s, median us per token, p99 us, first-mask us) of one grammar over `tokens`.

    Compiling includes the first matcher: llguidance compiles there, lazily.
    """
    start = time.perf_counter()
    grammar = engine.compile(kind)
    engine.matcher(grammar)
    compile_s = time.perf_counter() - start
    per_token: list[float] = []
    first: list[float] = []
    for _ in range(repeat):
        fill, accept = engine.matcher(grammar)
        for j, t in enumerate(tokens):
            start = time.perf_counter()
            fill()
            ok = accept(t)
            elapsed = time.perf_counter() - start
            (first if j == 0 else per_token).append(elapsed)
            assert ok, f"{engine.dist} refused token {j} of {kind}"
    per_token.sort()
    p99 = per_token[int(0.99 * (len(per_token) - 1))]
    return compile_s, statistics.median(per_token) * 1e6, p99 * 1e6, statistics.median(first) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20, help="passes over each token sequence")
    args = p.parse_args()

    from minisgl.utils.hf import load_hf_config, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    tokenizer = load_tokenizer(model_dir)
    vocab_size = load_hf_config(model_dir).vocab_size
    print(f"tokenizer of {model_dir}: vocab {vocab_size}")
    print(
        "| engine | version | installed MiB | requires | tokenizer s | grammar | compile ms "
        "| mask+advance us/token (median) | p99 | first mask us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cls in (Xgrammar, Llguidance, OutlinesCore):
        try:
            size, deps = installed(cls.dist)
            start = time.perf_counter()
            engine = cls(tokenizer, vocab_size)
            init_s = time.perf_counter() - start
        except (ImportError, md.PackageNotFoundError) as e:
            print(f"| {cls.dist} | not installed ({e}) |")
            continue
        version = md.version(cls.dist)
        for kind, text in CASES.items():
            tokens = tokenizer.encode(text, add_special_tokens=False)
            try:
                c, mean, p99, first = measure(engine, kind, tokens, args.repeat)
                row = f"{c * 1e3:.1f} | {mean:.1f} | {p99:.1f} | {first:.1f}"
            except Exception as e:  # an engine that cannot compile a grammar is a finding, not a crash
                row = f"failed: {type(e).__name__}: {str(e)[:60]} | | |"
            print(
                f"| {cls.dist} | {version} | {size:.1f} | {', '.join(deps) or 'none'} | {init_s:.2f} "
                f"| {kind} ({len(tokens)} tokens) | {row} |"
            )


if __name__ == "__main__":
    main()
