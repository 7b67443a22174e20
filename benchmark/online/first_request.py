"""The first requests a fresh server answers: time to first token from the moment /health first answers.

    python benchmark/online/first_request.py [--rounds 3] [--requests 3] [--json out.json] [--minisgl-args "..."]

Each round starts `python -m minisgl` (the default model unless --minisgl-args names one), waits for /health,
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
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from servers import REPO, _free_port, stop, wait_ready  # noqa: E402
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


def one_round(args: argparse.Namespace) -> list[float]:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        cmd = [sys.executable, "-m", "minisgl", "--port", str(port), *shlex.split(args.minisgl_args)]
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
    ap.add_argument("--minisgl-args", default="", help="more arguments for python -m minisgl")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        times = one_round(args)
        rounds.append(times)
        print(f"round {r}: time to first token, ms: " + " / ".join(f"{t:.1f}" for t in times), flush=True)
    firsts = [t[0] for t in rounds]
    later = [x for t in rounds for x in t[1:]]
    summary: dict[str, Any] = {"rounds": rounds, "first_median_ms": statistics.median(firsts)}
    if later:
        summary["later_median_ms"] = statistics.median(later)
    print(f"first request after start: median {summary['first_median_ms']:.1f} ms"
          + (f"; later requests {summary['later_median_ms']:.1f} ms" if later else ""))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
