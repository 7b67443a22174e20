"""Online serving: a concurrency sweep against OpenAI-compatible servers, printing TTFT, TPOT,
end-to-end latency (p50/p90/p99) and throughput.

Each level keeps `concurrency` streaming /v1/completions requests in flight (a closed loop: a
client sends its next request as soon as the last one ends). The workload is the same for every
server: text prompts of random common words (random.seed(0)), a fixed number of output tokens
(ignore_eos for minisgl, min_tokens for llama.cpp), greedy.

By default the script starts every server itself on the embedded model (SmolLM2-135M-Instruct;
llama.cpp reads the same GGUF file) and runs each level on each server in turn:
    python benchmark/online/bench.py --servers minisgl,llama.cpp --llama-cpp-python /path/to/python
or measures a server that is already running:
    python benchmark/online/bench.py --base-url http://127.0.0.1:30000 --name mine
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import openai

WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot word but what "
    "some we can out other were all there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him two has look more day could go "
    "come did number sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ turn cause much "
    "mean before move right boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men change went light kind"
).split()


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.output_tokens - 1, 1)


@dataclass
class LevelResult:
    server: str
    concurrency: int
    requests: int
    seconds: float
    input_tokens: int
    output_tokens: int
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "server": self.server,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "seconds": round(self.seconds, 2),
            "req_per_s": round(self.requests / self.seconds, 3),
            "output_tok_per_s": round(self.output_tokens / self.seconds, 1),
        }
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = round(_percentile(values, q) * 1000, 1)
        return out


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def make_prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, output_len: int) -> RequestResult:
    start = time.perf_counter()
    ttft = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0,
        stream=True,
        # the output length is fixed on both servers: each honours its own field and ignores the other's
        extra_body={"ignore_eos": True, "min_tokens": output_len},
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - start
            text += chunk.choices[0].text
    e2e = time.perf_counter() - start
    # counted from the text, the same way for every server (not every server reports usage in a stream)
    return RequestResult(ttft if ttft is not None else e2e, e2e, count_tokens([text]))


async def run_level(
    base_url: str,
    model: str,
    server: str,
    prompts: list[str],
    input_tokens: int,
    output_len: int,
    concurrency: int,
) -> LevelResult:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=3600)
    queue = list(prompts)
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            results.append(await one_request(client, model, queue.pop(), output_len))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    return LevelResult(
        server,
        concurrency,
        len(results),
        seconds,
        input_tokens,
        sum(r.output_tokens for r in results),
        [r.ttft for r in results],
        [r.tpot for r in results],
        [r.e2e for r in results],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, proc: subprocess.Popen | None = None, timeout: float = 600) -> str:
    """The served model's name, once /v1/models answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as resp:
                return json.load(resp)["data"][0]["id"]
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not become ready")


def server_command(name: str, port: int, args: argparse.Namespace) -> list[str]:
    if name == "minisgl":
        return [sys.executable, "-m", "minisgl", "--port", str(port), *args.minisgl_args.split()]
    if name == "llama.cpp":
        from minisgl.models.gguf import default_model_path

        # llama-cpp-python serves one request at a time; n_threads matches the machine's cores
        return [
            args.llama_cpp_python,
            "-m",
            "llama_cpp.server",
            "--model",
            default_model_path(),
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--n_threads",
            str(os.cpu_count() or 1),
            "--verbose",
            "False",
            # by default a new request cuts off the one being streamed; queue them instead
            "--interrupt_requests",
            "False",
        ]
    raise ValueError(f"unknown server {name!r}; use minisgl or llama.cpp")


@functools.cache
def _tokenizer() -> Any:
    from minisgl.utils.hf import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None))


def count_tokens(prompts: list[str]) -> int:
    return sum(len(_tokenizer().encode(p, add_special_tokens=False)) for p in prompts)


@dataclass
class Target:
    name: str
    base_url: str
    model: str


def sweep(targets: list[Target], args: argparse.Namespace) -> list[LevelResult]:
    """Every level on every server in turn, so load from elsewhere on the machine hits them alike."""
    results = []
    warmup = make_prompts(2, args.input_words, seed=args.seed + 1)
    for t in targets:
        asyncio.run(run_level(t.base_url, t.model, t.name, warmup, 0, 8, 2))
    for concurrency in args.concurrency:
        num = max(args.min_requests, args.requests_per_level * concurrency)
        prompts = make_prompts(num, args.input_words, seed=args.seed)
        for t in targets:
            level = asyncio.run(
                run_level(
                    t.base_url, t.model, t.name, prompts, count_tokens(prompts), args.output_len, concurrency
                )
            )
            print_row(level.summary())
            results.append(level)
    return results


HEADER = (
    f"{'server':<10} {'conc':>4} {'reqs':>5} {'req/s':>7} {'out tok/s':>9} | "
    f"{'TTFT p50/p90/p99 ms':>23} | {'TPOT p50/p90/p99 ms':>20} | {'E2E p50/p90/p99 ms':>26}"
)


def print_row(s: dict) -> None:
    def triple(name: str, width: int) -> str:
        return f"{s[f'{name}_p50_ms']:.0f}/{s[f'{name}_p90_ms']:.0f}/{s[f'{name}_p99_ms']:.0f}".rjust(width)

    print(
        f"{s['server']:<10} {s['concurrency']:>4} {s['requests']:>5} {s['req_per_s']:>7.2f} "
        f"{s['output_tok_per_s']:>9.1f} | {triple('ttft', 23)} | {triple('tpot', 20)} | {triple('e2e', 26)}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="minisgl,llama.cpp", help="servers to start and measure, in order")
    p.add_argument("--base-url", help="measure this running server instead of starting any")
    p.add_argument(
        "--name", default="server", help="the running server's name in the table (with --base-url)"
    )
    p.add_argument("--minisgl-args", default="", help="extra options for `python -m minisgl`")
    p.add_argument(
        "--llama-cpp-python", default=sys.executable, help="a Python that has llama-cpp-python[server]"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument(
        "--requests-per-level", type=int, default=2, help="requests per level = this x concurrency"
    )
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--input-words", type=int, default=100, help="words per prompt (about 1.2 tokens each)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="append every level's figures to this JSON-lines file")
    args = p.parse_args()

    print(HEADER, flush=True)
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        results = sweep([Target(args.name, base_url, _wait_ready(base_url))], args)
    else:
        # every server is started first and stays up (idle servers take no CPU) for the interleaved sweep
        procs: list[subprocess.Popen] = []
        try:
            targets = []
            for name in args.servers.split(","):
                port = _free_port()
                base_url = f"http://127.0.0.1:{port}"
                procs.append(subprocess.Popen(server_command(name, port, args), stdout=subprocess.DEVNULL))
                targets.append(Target(name, base_url, _wait_ready(base_url, procs[-1])))
            results = sweep(targets, args)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r.summary()) + "\n")


if __name__ == "__main__":
    main()
