"""The server's output path without the engine: what each hop costs a decode step of N streams.

A step of N running requests (one new token each, a real text's tokens of the default model) goes
through the three hops the server gives it, each timed alone in this one process, on the real code:
1. the scheduler's encoding of the step (`ZmqSchedulerIO.send_result` without the socket);
2. the tokenizer worker: decode the step's message, detokenize, build and encode the replies;
3. the API server: decode the worker's message, count each reply (`EngineClient._dispatch`), and run
   N `/v1/completions` streams to their SSE text (the HTTP write itself, h11 and the socket, not included);
   with `--behind K`, K steps arrive before the streams run, as when the server has fallen behind.
The figures are CPU milliseconds a step (the thread's own time, so other load on the machine does not
count) and the tokens a second each hop could pass on alone, with a core to itself; the engine's step
time (about 7 ms at batch 256 on an H200 for the 0.6B shape) is what they must stay well under.

    python benchmark/online/output_path.py --streams 64 256 --steps 100
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from minisgl.core import SamplingParams
from minisgl.message import DetokenizeMsg
from minisgl.message.frontend import SchedulerStats, TokenizeMsg
from minisgl.message.utils import deserialize, serialize
from minisgl.scheduler.check import RequestLimits
from minisgl.server.api_server import Choice, CompletionFormat, _first_replies, _stream
from minisgl.server.client import EngineClient
from minisgl.tokenizer.worker import TokenizerWorker, WorkerAddrs
from minisgl.utils.hf import load_tokenizer, resolve_model_path
from minisgl.utils.mp import ZmqPullQueue, ipc_addr

try:  # the scheduler's step encoding, where the code has one
    from minisgl.message.tokenizer import pack_step
except ImportError:

    def pack_step(msgs: list[Any]) -> list[Any]:
        return msgs


TEXT = (
    "The history of the city begins with a small settlement on the river, where traders from the north "
    "met farmers from the valleys. Over the centuries it grew into a market town, then a port, and "
    "finally a capital whose bridges, libraries and gardens drew visitors from every country. "
)


def steps_of(tokenizer: Any, streams: int, steps: int) -> list[list[Any]]:
    """The scheduler's messages: the first step a prefill (prompt counts), then plain decode steps."""
    ids = tokenizer.encode(TEXT * (1 + steps // 40), add_special_tokens=False)
    out = []
    for k in range(steps):
        step: list[Any] = []
        for u in range(streams):
            msg = DetokenizeMsg(u, ids[(k + 7 * u) % len(ids)], False)
            if k == 0:
                msg.prompt_tokens = 8
            step.append(msg)
        out.append([*step, SchedulerStats(running=streams)])
    return out


def run_worker(
    tokenizer: Any, folder: str, streams: int, steps: list[list[Any]]
) -> tuple[list[float], list[bytes]]:
    addrs = WorkerAddrs(*(ipc_addr(folder, n) for n in ("requests", "replies", "backend", "detok")))
    to_scheduler, to_api = ZmqPullQueue(addrs.backend), ZmqPullQueue(addrs.replies)
    worker = TokenizerWorker(tokenizer, RequestLimits(1 << 20, len(tokenizer), 1 << 30, 1), addrs)
    params = SamplingParams(max_tokens=1 << 16)
    worker._handle_api(
        [[TokenizeMsg([params], text="Tell me about the city.", uids=[u]) for u in range(streams)]]
    )
    while worker.pending:
        worker._tokenize_pending()
    times, sent = [], []
    for step in steps:
        data = serialize(pack_step(step))
        start = time.thread_time()
        worker._handle_scheduler([deserialize(data)])
        times.append(time.thread_time() - start)
        while to_api.socket.poll(0):
            sent.append(to_api.socket.recv())
    worker.close()
    to_scheduler.close()
    to_api.close()
    return times, sent


async def run_api(folder: str, streams: int, replies: list[bytes], behind: int) -> tuple[list[float], float]:
    client = EngineClient(ipc_addr(folder, "api-requests"), ipc_addr(folder, "api-replies"))
    written = [0] * streams
    writes = [0]

    async def one(i: int) -> None:
        fmt = CompletionFormat("m", 1, include_usage=False)
        group = client.submit([TokenizeMsg([SamplingParams()], text="x")], fmt.request_id)
        first = await _first_replies(group, fmt)
        watcher = asyncio.get_running_loop().create_future()
        async for piece in _stream(group, watcher, first, [Choice()], fmt):
            written[i] += len(piece.encode())
            writes[0] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    await asyncio.sleep(0)
    times = []
    for k in range(0, len(replies), behind):
        start = time.thread_time()
        for data in replies[k : k + behind]:
            for msg in deserialize(data):
                if not isinstance(msg, SchedulerStats):
                    client._dispatch(msg)
        for _ in range(3):  # every woken stream writes its chunk
            await asyncio.sleep(0)
        times.append((time.thread_time() - start) / len(replies[k : k + behind]))
    for t in tasks:
        t.cancel()
    client.close()
    assert all(written), "every stream wrote"
    return times, writes[0] / streams / len(replies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--behind",
        type=int,
        default=1,
        help="steps that reach the API server before its streams run (a server that has fallen behind)",
    )
    args = p.parse_args()
    tokenizer = load_tokenizer(resolve_model_path(None))
    print(f"{'streams':>7} | {'hop':<28} | {'CPU ms a step':>13} | {'tokens/s alone':>14}")
    for n in args.streams:
        steps = steps_of(tokenizer, n, args.steps)
        encode = []
        for step in steps[1:]:
            start = time.thread_time()
            serialize(pack_step(step))
            encode.append(time.thread_time() - start)
        with tempfile.TemporaryDirectory() as folder:
            worker, sent = run_worker(tokenizer, folder, n, steps)
            api, writes = asyncio.run(run_api(folder, n, sent, args.behind))
        for name, times in (
            ("scheduler: encode the step", encode),
            ("worker: detokenize the step", worker[1:]),
            ("API server: dispatch + SSE", api[1:]),
        ):
            ms = statistics.median(times) * 1000
            print(f"{n:>7} | {name:<28} | {ms:>13.2f} | {n / ms * 1000:>14.0f}", flush=True)
        print(f"{n:>7} | {'SSE writes a stream a step':<28} | {writes:>13.2f} |", flush=True)


if __name__ == "__main__":
    main()
