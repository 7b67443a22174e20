"""Online serving: TTFT, TPOT, end-to-end latency (p50/p90/p99) and throughput of OpenAI-compatible
servers, at fixed concurrencies (a closed loop) and at request rates replayed from a synthetic trace.

Concurrency levels (`--concurrency 1 4 16 64`): `concurrency` clients keep one streaming
/v1/completions request each in flight, sending the next as soon as the last ends, over
max(--min-requests, --requests-per-level x concurrency) requests. Prompts are random common words
(`--input-words`, random.seed(--seed)) or, with `--prompt-ids`, random token ids of U[--min-len,
--max-len] tokens, sent as `prompt: [ids]`, so that a random-weight checkpoint with any tokenizer can
be measured. Each request generates exactly --output-len tokens (minisgl: ignore_eos; llama.cpp:
min_tokens).

Request rates (`--request-rates 1 4 16 inf --num-requests 1000`): the requests of a synthetic trace
(see workload.py: Poisson arrivals, ShareGPT-like lognormal input and output lengths, seeded) are
sent at their arrival times whatever the server's progress (an open loop); every rate replays the
same requests.

TTFT is the time to the first chunk that carries text; TPOT is (end-to-end - TTFT) / (output
tokens - 1); output tokens are the server's own count (`usage.completion_tokens`), or the text
re-tokenized where a server reports none. Every request ends as a result or a counted error (an
HTTP error, a broken stream, or fewer tokens than asked); errors are printed with their reasons.

`--offline` adds, beside each level, minisgl's offline figure (`LLM.generate`) on the same requests
from the same checkpoint with the same engine options, run in this process after the servers stop.

By default the script starts every server itself (minisgl with `--minisgl-args`; llama.cpp reads
the embedded model's GGUF file), waits for /health, and stops them, children included:
    python benchmark/online/bench.py --servers minisgl --minisgl-args "--model ckpt --tp-size 4" \\
        --prompt-ids --request-rates 1 4 16 inf --num-requests 1000
    python benchmark/online/bench.py --servers minisgl,llama.cpp --llama-cpp-python /path/to/python
or measures a server that is already running:
    python benchmark/online/bench.py --base-url http://127.0.0.1:30000 --name mine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from servers import Target, started_servers  # noqa: E402
from sse import HTTPError, request  # noqa: E402
from workload import Request, TraceSpec, fixed_requests, make_trace, send_times  # noqa: E402


@dataclass
class RequestResult:
    e2e: float
    output_tokens: int
    # None: no chunk carried text (the first tokens of a byte-level tokenizer may decode to nothing)
    ttft: float | None
    input_tokens: int | None = None  # the server's count, where it reports usage

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    server: str
    level: str  # "c=16" or "rate=4"
    requests: int
    seconds: float
    results: list[RequestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    offline_tok_per_s: float | None = None

    def summary(self) -> dict[str, Any]:
        done = self.results
        out_tokens = sum(r.output_tokens for r in done)
        seconds = max(self.seconds, 1e-9)
        out: dict[str, Any] = {
            "server": self.server,
            "level": self.level,
            "requests": self.requests,
            "completed": len(done),
            "errors": len(self.errors),
            "seconds": round(self.seconds, 2),
            "req_per_s": round(len(done) / seconds, 3),
            "input_tokens": sum(r.input_tokens or 0 for r in done),
            "output_tokens": out_tokens,
            "output_tok_per_s": round(out_tokens / seconds, 1),
            "no_text": sum(r.ttft is None for r in done),
            # the level's first request to finish: with one client, the first sent (after start, on the first level)
            "ttft_first_ms": round(done[0].ttft * 1000, 1) if done and done[0].ttft is not None else None,
        }
        series = {
            "ttft": [r.ttft for r in done if r.ttft is not None],
            "tpot": [r.tpot for r in done if r.tpot is not None],
            "e2e": [r.e2e for r in done],
        }
        for name, values in series.items():
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = round(percentile(values, q) * 1000, 1) if values else None
        if self.offline_tok_per_s is not None:
            out["offline_tok_per_s"] = round(self.offline_tok_per_s, 1)
        if self.errors:
            out["error_reasons"] = sorted(set(self.errors))[:10]
        return out


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def request_body(t: Target, req: Request, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": t.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
    }
    # each server honours its own way of fixing the output length; llama-cpp-python's server reports no
    # usage in a stream, so its text is counted instead
    if t.kind == "llama.cpp":
        body["min_tokens"] = req.output_len
    else:
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(t: Target, req: Request, temperature: float, start: float) -> RequestResult:
    """`start`: when the request was due (a rate's arrival time), so a late send counts against it."""
    ttft, text, usage, finished = None, [], None, False
    async for status, event in request(f"{t.base_url}/v1/completions", request_body(t, req, temperature)):
        if status != 200 or isinstance(event, str) and event != "[DONE]":
            raise HTTPError(status, str(event))
        if event == "[DONE]":
            break
        if "error" in event:
            raise RuntimeError(f"error in the stream: {event['error']}")
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            if choice.get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice["text"])
            finished = finished or choice.get("finish_reason") is not None
    e2e = time.perf_counter() - start
    if not finished:
        raise RuntimeError("the stream ended without a finish_reason")
    tokens = usage["completion_tokens"] if usage else t.count_tokens("".join(text))
    if tokens < req.output_len:
        raise RuntimeError(f"short: {tokens} of {req.output_len} tokens")
    return RequestResult(e2e, tokens, ttft, usage["prompt_tokens"] if usage else None)


# a request that takes longer is an error (TimeoutError), so a stuck stream cannot hang the run
REQUEST_TIMEOUT_S = 1800.0


async def _guarded(t: Target, req: Request, temperature: float, start: float, level: LevelResult) -> None:
    try:
        result = await asyncio.wait_for(one_request(t, req, temperature, start), REQUEST_TIMEOUT_S)
        level.results.append(result)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported, none stops the level
        level.errors.append(f"{type(e).__name__}: {e}"[:300])


async def run_closed(t: Target, reqs: list[Request], concurrency: int, temperature: float) -> LevelResult:
    level = LevelResult(t.name, f"c={concurrency}", len(reqs), 0.0)
    queue = list(reversed(reqs))

    async def client() -> None:
        while queue:
            await _guarded(t, queue.pop(), temperature, time.perf_counter(), level)

    begin = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    level.seconds = time.perf_counter() - begin
    return level


async def run_rate(t: Target, reqs: list[Request], rate: float, temperature: float) -> LevelResult:
    level = LevelResult(t.name, f"rate={rate:g}", len(reqs), 0.0)
    begin = time.perf_counter()

    async def send(req: Request, at: float) -> None:
        await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
        await _guarded(t, req, temperature, begin + at, level)

    await asyncio.gather(*(send(r, at) for r, at in zip(reqs, send_times(reqs, rate), strict=True)))
    level.seconds = time.perf_counter() - begin
    return level


@dataclass
class Plan:
    """The requests of every level: (concurrency, requests) and (rate, requests); every rate has the
    same requests."""

    closed: list[tuple[int, list[Request]]]
    rates: list[tuple[float, list[Request]]]


def make_plan(args: argparse.Namespace, vocab: int | None) -> Plan:
    closed = []
    for c in args.concurrency:
        num = max(args.min_requests, args.requests_per_level * c)
        if vocab:
            reqs = fixed_requests(num, args.min_len, args.max_len, args.output_len, args.seed, vocab)
        else:
            reqs = fixed_requests(num, args.input_words, args.input_words, args.output_len, args.seed, None)
        closed.append((c, reqs))
    trace = make_trace(args.num_requests, trace_spec(args), args.seed, vocab) if args.request_rates else []
    return Plan(closed, [(r, trace) for r in args.request_rates])


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    return TraceSpec(
        input_median=args.input_median,
        input_max=args.input_max,
        output_median=args.output_median,
        output_max=args.output_max,
    )


def sweep(targets: list[Target], plan: Plan, args: argparse.Namespace) -> list[LevelResult]:
    """Every level on every server in turn, so load from elsewhere on the machine hits them alike."""
    results = []
    warmup = fixed_requests(2, 8, 8, 8, args.seed + 1, None)
    for t in targets:
        warm = asyncio.run(run_closed(t, warmup, 2, 0.0))
        if warm.errors:
            raise RuntimeError(f"{t.name} failed its warm-up requests: {warm.errors[0]}")
    levels: list[tuple[str, Any]] = [("c", c) for c, _ in plan.closed] + [("rate", r) for r, _ in plan.rates]
    for (kind, value), (_, reqs) in zip(levels, plan.closed + plan.rates, strict=True):
        for t in targets:
            if kind == "c":
                level = asyncio.run(run_closed(t, reqs, value, args.temperature))
            else:
                level = asyncio.run(run_rate(t, reqs, value, args.temperature))
            print_row(level.summary())
            for reason in sorted(set(level.errors))[:5]:
                print(f"    error ({level.errors.count(reason)}x): {reason}", flush=True)
            results.append(level)
    return results


def run_offline(args: argparse.Namespace, plan: Plan, results: list[LevelResult]) -> None:
    """minisgl's LLM.generate on each level's requests, max_running_req = the level's concurrency
    (the server's own limit for a rate), with the server's engine options."""
    from offline_llm import offline_tok_per_s

    by_level: dict[str, float] = {}
    for c, reqs in plan.closed:
        by_level[f"c={c}"] = offline_tok_per_s(args.minisgl_args, reqs, c, args.temperature)
        print(f"offline c={c}: {by_level[f'c={c}']:.1f} output tok/s", flush=True)
    if plan.rates:
        tok_s = offline_tok_per_s(args.minisgl_args, plan.rates[0][1], None, args.temperature)
        print(f"offline, the trace's requests all at once: {tok_s:.1f} output tok/s", flush=True)
        for r, _ in plan.rates:
            by_level[f"rate={r:g}"] = tok_s
    for level in results:
        level.offline_tok_per_s = by_level.get(level.level)


HEADER = (
    f"{'server':<10} {'level':>9} {'done':>5} {'err':>4} {'req/s':>7} {'out tok/s':>9} {'offline':>8} | "
    f"{'TTFT p50/p90/p99 ms':>21} | {'TPOT p50/p90/p99 ms':>20} | {'E2E p50/p90/p99 ms':>23}"
)


def print_row(s: dict[str, Any]) -> None:
    def triple(name: str, width: int) -> str:
        values = [s[f"{name}_p{q}_ms"] for q in (50, 90, 99)]
        return "/".join("-" if v is None else f"{v:.0f}" for v in values).rjust(width)

    offline = s.get("offline_tok_per_s")
    print(
        f"{s['server']:<10} {s['level']:>9} {s['completed']:>5} {s['errors']:>4} {s['req_per_s']:>7.2f} "
        f"{s['output_tok_per_s']:>9.1f} {'' if offline is None else f'{offline:.1f}':>8} | "
        f"{triple('ttft', 21)} | {triple('tpot', 20)} | {triple('e2e', 23)}",
        flush=True,
    )


def served_model_path(args: argparse.Namespace) -> str | None:
    """Where the measured model's tokenizer and config are: --tokenizer, else minisgl's --model."""
    if args.tokenizer:
        return args.tokenizer
    split = shlex.split(args.minisgl_args)
    for i, a in enumerate(split):
        if a == "--model" and i + 1 < len(split):
            return split[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def model_vocab(path: str | None) -> int:
    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    return ModelConfig.from_hf(load_hf_config(resolve_model_path(path))).vocab_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--servers", default="minisgl", help="servers to start and measure, in order (minisgl, llama.cpp)"
    )
    p.add_argument("--base-url", help="measure this running server instead of starting any")
    p.add_argument(
        "--name", default="server", help="the running server's name in the table (with --base-url)"
    )
    p.add_argument(
        "--minisgl-args", default="", help="options for `python -m minisgl`, e.g. '--model X --tp-size 4'"
    )
    p.add_argument(
        "--llama-cpp-python", default=sys.executable, help="a Python that has llama-cpp-python[server]"
    )
    p.add_argument(
        "--llama-cpp-model", help="the GGUF file llama.cpp serves (default: the embedded model's file)"
    )
    p.add_argument(
        "--llama-cpp-threads", type=int, default=0, help="llama.cpp's threads (0: as many as minisgl's torch)"
    )
    p.add_argument(
        "--tokenizer",
        help="the served model's folder, for its vocabulary and tokenizer (default: minisgl's --model, "
        "else the embedded model)",
    )
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to start")
    p.add_argument(
        "--server-log", help="write each started server's output to PATH.NAME (default: a temp file)"
    )
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64], help="closed-loop levels")
    p.add_argument(
        "--requests-per-level", type=int, default=2, help="requests of a level = this x concurrency"
    )
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--input-words", type=int, default=100, help="words per text prompt (about a token each)")
    p.add_argument(
        "--prompt-ids", action="store_true", help="token-id prompts of U[--min-len, --max-len] tokens"
    )
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128, help="new tokens of each closed-loop request")
    p.add_argument(
        "--request-rates",
        type=float,
        nargs="*",
        default=[],
        help="requests/s of the trace replay; inf sends them all at once (e.g. 1 4 16 inf)",
    )
    p.add_argument("--num-requests", type=int, default=1000, help="requests of the trace")
    p.add_argument("--input-median", type=float, default=200.0, help="the trace's median prompt tokens")
    p.add_argument("--input-max", type=int, default=2048)
    p.add_argument("--output-median", type=float, default=150.0, help="the trace's median output tokens")
    p.add_argument("--output-max", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help="minisgl's LLM.generate on the same requests")
    p.add_argument("--json", help="append every level's figures to this JSON-lines file")
    args = p.parse_args(argv)
    if any(r <= 0 or math.isnan(r) for r in args.request_rates):
        p.error("--request-rates must be positive (inf: all at once)")
    if args.offline and args.base_url:
        p.error("--offline needs the server's options: start it with --minisgl-args, not --base-url")
    return args


def raise_open_files_limit() -> None:
    """As many open files as allowed: 1,000 requests at once are 1,000 sockets here and in the server,
    which inherits the limit, and the usual soft limit is 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit is still capped by the kernel's nr_open
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def main() -> None:
    args = parse_args()
    raise_open_files_limit()
    # `timeout` stops a run with SIGTERM: exit through every `finally`, so servers and engines shut down
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    path = served_model_path(args)
    plan = make_plan(args, model_vocab(path) if args.prompt_ids else None)
    if plan.closed:
        prompt = (
            f"token-id prompts of U[{args.min_len}, {args.max_len}] tokens"
            if args.prompt_ids
            else f"prompts of {args.input_words} random words"
        )
        print(f"closed loop: {prompt}, {args.output_len} output tokens each, seed {args.seed}")
    if plan.rates:
        trace = plan.rates[0][1]
        # a word prompt has as many words as the trace's length, about as many tokens
        size = sum(len(r.prompt) if args.prompt_ids else len(r.prompt.split()) for r in trace)
        print(
            f"trace: {len(trace)} requests, seed {args.seed}; {trace_spec(args).describe()}; "
            f"{size} prompt {'tokens' if args.prompt_ids else 'words'}, {sum(r.output_len for r in trace)} "
            "output tokens"
        )
    print(HEADER, flush=True)
    with started_servers(args, path) as targets:
        results = sweep(targets, plan, args)
    if args.offline:
        run_offline(args, plan, results)
        print(HEADER)
        for level in results:
            print_row(level.summary())
    lost = sum(r.requests - len(r.results) - len(r.errors) for r in results)
    if lost:
        print(f"LOST REQUESTS: {lost} got neither an answer nor an error", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                extra = {"trace": trace_spec(args).describe()} if r.level.startswith("rate") else {}
                f.write(json.dumps(r.summary() | extra) + "\n")
    if lost or any(r.errors for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
