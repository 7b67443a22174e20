"""What a JSON schema costs to check and to compile, by its size, on the default model's tokenizer, and
how much of that a loop running beside the compile thread loses.

For schemas of 5 to 2000 properties: the check the API server and the tokenizer worker run (the grammar
built without the tokenizer, `check_grammar`'s work), the compile against the tokenizer that the
scheduler's compile thread runs, and the share of 1 ms sleeps a main-thread loop completed while that
compile ran (1.0: the compile never held the GIL from it). Caches are off, so each size compiles cold.
    python benchmark/offline/grammar_compile.py
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any


def schema(properties: int) -> str:
    kinds = ["string", "integer", "boolean"]
    return json.dumps(
        {
            "type": "object",
            "properties": {f"field_{i}": {"type": kinds[i % 3]} for i in range(properties)},
            "required": [f"field_{i}" for i in range(properties)],
        }
    )


def _compile(compiler: Any, text: str, took: list[float], done: threading.Event) -> None:
    start = time.perf_counter()
    compiler.compile_json_schema(text, any_whitespace=False)
    took.append(time.perf_counter() - start)
    done.set()


def main() -> None:
    import xgrammar as xgr

    from minisgl.constrained.grammar import MAX_GRAMMAR_CHARS, _schema
    from minisgl.utils.hf import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    start = time.perf_counter()
    for _ in range(200):
        time.sleep(0.001)
    tick = (time.perf_counter() - start) / 200  # one turn of the loop with nothing beside it
    print(f"limit: {MAX_GRAMMAR_CHARS} characters; a loop turn alone: {tick * 1e3:.2f} ms")
    print(f"{'properties':>10} {'characters':>10} {'check ms':>9} {'compile ms':>11} {'loop kept':>9}")
    for n in (5, 50, 200, 500, 1000, 2000):
        text = _schema(schema(n))
        start = time.perf_counter()
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
        check = time.perf_counter() - start
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        done = threading.Event()
        took: list[float] = []

        thread = threading.Thread(target=_compile, args=(compiler, text, took, done))
        ticks, start = 0, time.perf_counter()
        thread.start()
        while not done.is_set():
            time.sleep(0.001)
            ticks += 1
        elapsed = time.perf_counter() - start
        thread.join()
        kept = ticks * tick / elapsed
        print(f"{n:>10} {len(text):>10} {check * 1e3:>9.1f} {took[0] * 1e3:>11.1f} {kept:>9.2f}")


if __name__ == "__main__":
    main()
