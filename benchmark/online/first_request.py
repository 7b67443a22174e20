"""The first requests a fresh server answers: time to first token from the moment the server is ready.

    python benchmark/online/first_request.py [--rounds 3] [--requests 3] [--json out.json] [--minisgl-args "..."]
        [--servers minisgl,llama.cpp --llama-cpp-python /path/to/python]

Each round starts each server of --servers (`python -m minisgl` on the default model unless --minisgl-args names
one; llama.cpp's server on the same GGUF file, as benchmark/online/bench.py starts it), waits until it answers,
then at once sends --requests streaming chat requests one after another (8 tokens each, temperature 0.7 and
top-p 0.9, a different question each) and takes each one's time to its first content token, as a client sees
it. The first request after start is what a user who starts the server and asks at once waits for; the later
ones are the warm figure beside it (they reuse the chat template's cached prefix, the first cannot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from servers import REPO, _free_port, server_command, stop, wait_ready  # noqa: E402
from sse import get_json, request  # noqa: E402


async def ttft_ms(base_url: str, model: str, question: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    async for status, event in request(f"{base_url}/v1/chat/completions", body):
        if status != 200:
            raise RuntimeError(f"the request failed with {status}: {event}")
        if (
            first is None
            and isinstance(event, dict)
            and event["choices"]
            and event["choices"][0]["delta"].get("content")
        ):
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without a content token")
    return (first - start) * 1e3


def one_round(args: argparse.Namespace, kind: str) -> list[float]:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        cmd = server_command(kind, port, args)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        model = wait_ready(base_url, proc, timeout=300, log=log.name)

        async def run() -> list[float]:
            await get_json(f"{base_url}/health")  # the client's own first connection, not timed
            return [
                await ttft_ms(base_url, model, f"Tell me about the number {i} in two sentences.")
                for i in range(args.requests)
            ]

        return asyncio.run(run())
    finally:
        stop(proc)
        os.unlink(log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--servers", default="minisgl", help="servers to start and measure (minisgl, llama.cpp)")
    ap.add_argument("--minisgl-args", default="", help="more arguments for python -m minisgl")
    ap.add_argument(
        "--llama-cpp-python", default=sys.executable, help="a Python with llama-cpp-python[server]"
    )
    ap.add_argument(
        "--llama-cpp-model", help="the GGUF file llama.cpp serves (default: the embedded model's)"
    )
    ap.add_argument("--llama-cpp-threads", type=int, default=0, help="0: as many as minisgl's torch threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    summary: dict[str, Any] = {}
    for kind in args.servers.split(","):
        rounds = []
        for r in range(args.rounds):
            times = one_round(args, kind)
            rounds.append(times)
            print(
                f"{kind} round {r}: time to first token, ms: " + " / ".join(f"{t:.1f}" for t in times),
                flush=True,
            )
        later = [x for t in rounds for x in t[1:]]
        row: dict[str, Any] = {"rounds": rounds, "first_median_ms": statistics.median(t[0] for t in rounds)}
        if later:
            row["later_median_ms"] = statistics.median(later)
        summary[kind] = row
        print(f"{kind}: first request after start: median {row['first_median_ms']:.1f} ms"
              + (f"; later requests {row['later_median_ms']:.1f} ms" if later else ""), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
