"""llama.cpp (llama-cpp-python's C API) as a peer: many streams decoded together, in a child process.

The Python class `Llama` decodes one sequence at a time; llama.cpp itself decodes a batch of
sequences in one `llama_decode` (its `batched` example, and `llama-server -np N`). This peer does
that through the binding's low-level calls: every prompt in one batch (one sequence id each), then
one token a running sequence a step, greedy (argmax of the logits), each sequence stopping at its own
output length. The model runs in a child process, so a crash in llama.cpp (its AMX path has
segfaulted on some machines) costs its column, not the run.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import numpy as np

# a request: (prompts, output lengths); the answer: seconds, or an error's text
Job = tuple[list[list[int]], list[int]]


class BatchedLlama:
    """One model and one context with room for `streams` sequences of up to `seq_len` tokens each."""

    def __init__(self, path: str, streams: int, seq_len: int, batch_tokens: int, threads: int) -> None:
        import llama_cpp as lc
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_seq_max = streams
        # one KV stream per sequence: the prompts share nothing
        params.kv_unified = False
        params.n_ctx = streams * seq_len
        params.n_batch = batch_tokens
        params.n_ubatch = min(batch_tokens, 512)
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch_tokens = batch_tokens
        self.batch = lc.llama_batch_init(batch_tokens, 0, 1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if (rc := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        logits = self.lc.llama_get_logits_ith(self.ctx, index)
        return int(
            np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.vocab,)).argmax()
        )

    def _pick(
        self,
        rows: list[tuple[int, int, int, bool]],
        prompts: list[list[int]],
        lens: list[int],
        made: list[int],
    ) -> list[tuple[int, int, int, bool]]:
        """The next step's rows: each sequence whose logits this batch gave, and that wants more tokens."""
        step = []
        for i, (_, _, s, want) in enumerate(rows):
            if want:
                tok = self._argmax(i)
                made[s] += 1
                if made[s] < lens[s]:
                    step.append((tok, len(prompts[s]) + made[s] - 1, s, True))
        return step

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        """Seconds to prefill every prompt and generate output_lens[i] tokens for prompt i."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        rows = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        made = [0] * len(prompts)
        pending: list[tuple[int, int, int, bool]] = []
        # a decode overwrites the last one's logits: each batch's tokens are picked before the next
        for lo in range(0, len(rows), self.batch_tokens):
            chunk = rows[lo : lo + self.batch_tokens]
            self._decode(chunk)
            pending += self._pick(chunk, prompts, output_lens, made)
        while pending:
            self._decode(pending)
            pending = self._pick(pending, prompts, output_lens, made)
        return time.perf_counter() - start

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def _serve(conn: Connection, path: str, streams: int, seq_len: int, batch_tokens: int, threads: int) -> None:
    llm = BatchedLlama(path, streams, seq_len, batch_tokens, threads)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        try:
            conn.send(llm.generate(*job))
        except Exception as e:  # noqa: BLE001 - the parent reports it and drops the column
            conn.send(f"{type(e).__name__}: {e}")
    llm.close()


class LlamaCppPeer:
    """The child process that holds one GGUF file's model; `run` returns seconds, or None once it failed."""

    def __init__(self, path: str, streams: int, seq_len: int, batch_tokens: int, threads: int) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_serve, args=(child, path, streams, seq_len, batch_tokens, threads), daemon=True
        )
        self.proc.start()
        self.error: str | None = None
        self._answer()

    def _answer(self) -> float | str | None:
        try:
            answer = self.conn.recv()
        except EOFError:
            answer = f"the llama.cpp process died (exit code {self.proc.join(5) or self.proc.exitcode})"
        if isinstance(answer, str) and answer != "ready":
            self.error = answer
            print(f"llama.cpp: {answer}", flush=True)
        return answer

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> float | None:
        if self.error:
            return None
        self.conn.send((prompts, output_lens))
        answer = self._answer()
        return answer if isinstance(answer, float) else None

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
