"""A timeline of a run, written as Chrome / Perfetto trace-event JSON (open it at ui.perfetto.dev).

Off unless a path is given: `MINISGL_TRACE=path.json`, `--trace path.json` on the server, or
`LLM(..., trace="path.json")`. Then every process writes its own events, one JSON object a line,
to `<path>.<process>-<pid>.part`, and the process that owns the run (the server launcher once its
children have stopped, or the offline `LLM` at shutdown) merges them into the one file `<path>`.
docs/trace.md says how to read it.

- A track per process (API server, tokenizer worker, scheduler), and one for the device.
- Per scheduler step: a "prefill" or "decode" slice (batch, tokens, cached tokens, host prepare
  time, device time) holding "prepare" and "forward" ("launch" on CUDA, where the forward runs
  later on the device track), then a "results" slice when its tokens are handled, and counters
  of running and waiting requests, KV pages and the prefix-cache hit rate.
- Per request: one flow (an arrow in Perfetto) through every point of its life, from its arrival
  through tokenize, queued, each prefill chunk, first token and finish or abort to its answer.

Timestamps are microseconds of CLOCK_MONOTONIC, one clock for every process of the machine; on a
process's own track they only go forward, so its slices nest by construction. Device times come
from CUDA events on a GPU (placed on that clock by one synchronised event at the first step) and
from the host clock on a CPU, where the forward pass is synchronous. When tracing is off every
call returns after one attribute check.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import re
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from minisgl.core import ChunkedReq
from minisgl.env import ENV
from minisgl.message.tokenizer import TokenStepMsg
from minisgl.utils.logger import init_logger

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.message import DetokenizeMsg
    from minisgl.scheduler.scheduler import Scheduler

logger = init_logger(__name__)

# Perfetto joins a flow's events on (id, category, name): every point of every request shares these
FLOW = "request"
ARRIVAL = "arrival"  # the point that starts a request's flow
_DEVICE_TID = 1 << 30  # added to the scheduler's pid: a thread id no real thread has
_NULL = contextlib.nullcontext()
_encode = json.JSONEncoder(separators=(",", ":")).encode


def now_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass
class _Step:
    """A step between its scheduling and the handling of its results (one later step, under overlap)."""

    args: dict[str, Any]
    begin: int
    prepared: int
    forward_begin: int = 0
    forward_end: int = 0
    cuda_events: list[Any] | None = None  # start and end, on the engine's stream


class Tracer:
    """The trace of this process; `TRACE` below is the one every module calls."""

    def __init__(self) -> None:
        self.on = False
        self.path = ""
        self._owner = False
        self._file: IO[str] | None = None
        self._pid = self._tid = self._device_tid = 0
        self._cuda = False
        self._atexit = False
        self._reset()

    def _reset(self) -> None:
        self._last = 0  # the latest timestamp on the host track
        self._depth = 0  # slices open on the host track: a point outside all of them gets one of its own
        self._num_steps = 0
        self._step_begin = 0
        self._step: _Step | None = None  # scheduled, not yet launched
        self._inflight: deque[_Step] = deque()  # launched, results not yet handled
        self._results: tuple[int, dict[str, Any]] = (0, {})
        self._anchor: tuple[Any, int] | None = None  # a CUDA event and the host time it completed at
        self._device_last = 0

    # ---- start and finish --------------------------------------------------------------------
    def start(self, path: str | None, process: str, owner: bool = False, device: str | None = None) -> None:
        """Trace this process, shown as `process`, to `path` (None: MINISGL_TRACE; empty: off).

        The owner merges every process's part into `path` at `finish()`; `device` ("cpu", "cuda")
        adds the device track.
        """
        path = path or ENV.TRACE.value
        if not path:
            return
        if self.on:
            logger.warning(f"the trace to {self.path} is finished here: another one starts")
            self.finish()
        self.path = os.path.abspath(path)
        if owner:
            # left by a run that never merged them (a rank started beside this one may have begun already)
            for stale in _parts(self.path):
                if not _alive(int(stale.rsplit("-", 1)[1].split(".")[0])):
                    os.remove(stale)
        self._pid, self._tid = os.getpid(), threading.get_native_id()
        slug = re.sub(r"\W+", "-", process).strip("-").lower()
        self._file = open(f"{self.path}.{slug}-{self._pid}.part", "w", buffering=1 << 16)
        self.on, self._owner = True, owner
        self._reset()
        self._meta("process_name", self._tid, process)
        self._meta("thread_name", self._tid, "host")
        self._device_tid = _DEVICE_TID + self._pid
        self._cuda = device is not None and device.startswith("cuda")
        if device is not None:
            clock = "CUDA events" if self._cuda else "the forward pass on the host"
            self._meta("thread_name", self._device_tid, f"device {device} ({clock})")
        if not self._atexit:  # a script that never shuts its engine down still gets its trace
            atexit.register(self.finish)
            self._atexit = True

    def finish(self) -> None:
        """Close this process's part; the owner then merges every part into the trace file."""
        if not self.on:
            return
        self.on = False
        assert self._file is not None
        self._file.close()
        self._file = None
        if self._owner:
            count = merge_trace(self.path)
            logger.info(f"trace of {count} events written to {self.path} (open it at ui.perfetto.dev)")

    # ---- any process -------------------------------------------------------------------------
    def slice(self, name: str) -> AbstractContextManager[None]:
        """`with TRACE.slice("tokenize"):` a slice on this process's track around the block."""
        return self._open_slice(name) if self.on else _NULL

    def point(self, uid: int, step: str, detail: Any = None) -> None:
        """A point of request `uid`'s life here: part of its flow, in the slice open now or in one of its own."""
        if not self.on:
            return
        if self._depth:
            self._flow(uid, step, detail)
            return
        begin = self._tick()
        self._flow(uid, step, detail)
        args = {"uid": uid} if detail is None else {"uid": uid, "detail": detail}
        self._slice(step, begin, self._tick(), args)

    def arrivals(self, uids: list[int]) -> None:
        """Requests that have just arrived: where their flows start."""
        if not self.on:
            return
        begin = self._tick()
        for uid in uids:
            self._flow(uid, ARRIVAL)
        self._slice(ARRIVAL, begin, self._tick(), {"uids": list(uids)})

    # ---- the scheduler -----------------------------------------------------------------------
    def step_begin(self) -> None:
        if self.on:
            self._step_begin = self._tick()

    def step_prepared(self, batch: Batch | None) -> None:
        """The batch this step runs (None: nothing runs), scheduled and prepared: each prefill chunk is a point."""
        if not self.on or batch is None:
            return
        prepared = self._tick()
        self._num_steps += 1
        reqs = batch.reqs
        args: dict[str, Any] = {
            "step": self._num_steps,
            "kind": batch.phase,
            "batch_size": batch.size,
            "tokens": sum(r.extend_len for r in reqs),
            "cached_tokens": 0,
            "uids": [r.uid for r in reqs],
        }
        if batch.padded_size != batch.size:
            args["padded_size"] = batch.padded_size
        if batch.is_prefill:
            # a mixed step's decode rows decode as they would in a decode step
            decoding = batch.num_decode_rows
            if decoding:
                args["decode_rows"] = decoding
                reqs = reqs[: len(reqs) - decoding]
            # a request whose prefill starts now reads num_cached_tokens from the prefix cache
            args["cached_tokens"] = sum(r.cached_len for r in reqs if r.cached_len == r.num_cached_tokens)
            args["chunked"] = sum(isinstance(r, ChunkedReq) for r in reqs)
            for r in reqs:
                what = "chunk" if isinstance(r, ChunkedReq) else "prefill"
                self._flow(r.uid, what, {"tokens": r.extend_len, "cached": r.cached_len})
        self._step = _Step(args, self._step_begin, prepared)

    def forward_begin(self) -> None:
        if not self.on or self._step is None:
            return
        self._step.forward_begin = self._tick()
        if self._cuda:
            import torch

            if self._anchor is None:  # the one synchronisation: where CUDA time meets host time
                anchor = torch.cuda.Event(enable_timing=True)
                anchor.record()
                anchor.synchronize()
                self._anchor = (anchor, now_us())
            self._step.cuda_events = [torch.cuda.Event(enable_timing=True)]
            self._step.cuda_events[0].record()

    def forward_end(self) -> None:
        if not self.on or self._step is None:
            return
        step, self._step = self._step, None
        if step.cuda_events is not None:
            import torch

            step.cuda_events.append(torch.cuda.Event(enable_timing=True))
            step.cuda_events[1].record()
        step.forward_end = self._tick()
        self._inflight.append(step)

    def step_sampled(self) -> None:
        """The sampling of the step launched last is queued, apart from its model (a batch with constrained
        rows samples after the previous step's results): its device slice ends after the sampling."""
        if not self.on or not self._inflight:
            return
        step = self._inflight[-1]
        if step.cuda_events is not None:
            import torch

            step.cuda_events[1] = torch.cuda.Event(enable_timing=True)
            step.cuda_events[1].record()

    def results_begin(self) -> None:
        if self.on:
            self._results = (self._tick(), {})
            self._depth += 1

    def step_done(self, scheduler: Scheduler, reply: list[DetokenizeMsg | TokenStepMsg]) -> None:
        """The oldest step in flight has its results: its slices, its first tokens and finishes, the counters."""
        if not self.on or not self._inflight:
            return
        step = self._inflight.popleft()
        finished = []
        replies = 0
        for msg in reply:
            if isinstance(msg, TokenStepMsg):  # plain tokens: no first token, no finish
                replies += len(msg.uids)
                continue
            replies += 1
            if msg.prompt_tokens:
                self._flow(msg.uid, "first token", {"cached": msg.cached_tokens})
            if msg.finished:
                self._flow(msg.uid, "finish", msg.finish_reason)
                finished.append(msg.uid)
        args = step.args
        self._results[1].update(step=args["step"], replies=replies, finished=finished)
        device_begin, device_end = self._device_times(step)
        args["prepare_us"] = step.prepared - step.begin
        args["launch_us" if self._cuda else "forward_us"] = step.forward_end - step.forward_begin
        args["device_us"] = device_end - device_begin
        kind = args["kind"]
        self._slice(kind, step.begin, step.forward_end, args)
        self._slice("prepare", step.begin, step.prepared)
        self._slice("launch" if self._cuda else "forward", step.forward_begin, step.forward_end)
        device_args = {k: args[k] for k in ("step", "batch_size", "tokens", "device_us")}
        self._slice(kind, device_begin, device_end, device_args, self._device_tid)
        self._counters(scheduler)

    def results_end(self) -> None:
        if self.on:
            self._depth -= 1
            begin, args = self._results
            self._slice("results", begin, self._tick(), args)

    # ---- events ------------------------------------------------------------------------------
    def _tick(self) -> int:
        """Now, and later than anything before it on this process's host track."""
        self._last = max(now_us(), self._last + 1)
        return self._last

    def _emit(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(_encode(event) + "\n")

    def _meta(self, name: str, tid: int, value: str) -> None:
        self._emit({"ph": "M", "name": name, "pid": self._pid, "tid": tid, "args": {"name": value}})

    def _slice(
        self, name: str, begin: int, end: int, args: dict[str, Any] | None = None, tid: int = 0
    ) -> None:
        event = {"ph": "X", "name": name, "ts": begin, "dur": end - begin, "pid": self._pid}
        event["tid"] = tid or self._tid
        if args:
            event["args"] = args
        self._emit(event)

    def _flow(self, uid: int, step: str, detail: Any = None) -> None:
        # phase and id are set when the parts are merged: only then are a request's points all known
        args = {"uid": uid, "step": step} if detail is None else {"uid": uid, "step": step, "detail": detail}
        event = {"ph": "t", "name": FLOW, "cat": FLOW, "ts": self._tick(), "pid": self._pid, "tid": self._tid}
        self._emit(event | {"args": args})

    @contextlib.contextmanager
    def _open_slice(self, name: str) -> Iterator[None]:
        begin = self._tick()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._slice(name, begin, self._tick())

    def _device_times(self, step: _Step) -> tuple[int, int]:
        if step.cuda_events is None:  # the CPU: the forward pass ran on the host, synchronously
            return step.forward_begin, step.forward_end
        start, end = step.cuda_events
        # recorded right after the step's copy to the host, which the scheduler has just waited for
        end.synchronize()
        assert self._anchor is not None
        anchor, anchor_us = self._anchor
        begin = max(anchor_us + round(anchor.elapsed_time(start) * 1000), self._device_last)
        finish = max(anchor_us + round(anchor.elapsed_time(end) * 1000), begin + 1)
        self._device_last = finish
        return begin, finish

    def _counters(self, scheduler: Scheduler) -> None:
        stats, cache = scheduler.stats(), scheduler.cache_stats
        hit_rate = cache.cached_tokens / cache.prompt_tokens if cache.prompt_tokens else 0.0
        counters = {
            "requests": {"running": stats.running, "waiting": stats.waiting},
            "kv pages": {
                "free": stats.kv_pages_free,
                "cached": stats.kv_pages_cached,
                "held": stats.kv_pages_held,
            },
            "prefix cache": {"hit rate": round(hit_rate, 4)},
        }
        ts = self._tick()
        for name, values in counters.items():
            self._emit(
                {"ph": "C", "name": name, "ts": ts, "pid": self._pid, "tid": self._tid, "args": values}
            )


TRACE = Tracer()


def trace_server(path: str | None) -> None:
    """The server launcher: trace this process (the API server) and, through MINISGL_TRACE in the
    environment they inherit, the processes it spawns next."""
    path = path or ENV.TRACE.value
    if path:
        os.environ[ENV.TRACE.name] = os.path.abspath(path)
        TRACE.start(path, "API server", owner=True)


# ---- merging ---------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parts(path: str) -> list[str]:
    return sorted(glob.glob(glob.escape(path) + ".*.part"))


def merge_trace(path: str) -> int:
    """Merge every process's part of the trace `path` into the file `path`, remove the parts, and
    return the number of events. Each request's points become its flow."""
    events: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for part in _parts(path):
        with open(part) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the cut last line of a process that was killed
                (points if event["ph"] == "t" else events).append(event)
        os.remove(part)
    events += _flows(points)
    # names first; a parent slice before the child that starts with it
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))
    with open(path + ".tmp", "w") as f:
        json.dump({"traceEvents": events}, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)
    return len(events)


def _flows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request's points in time order become one flow: "s" first, "t" between, "f" last.

    An arrival always starts a new flow: the offline LLM numbers each generate call's requests from 0.
    """
    by_uid: dict[int, list[list[dict[str, Any]]]] = defaultdict(list)
    for p in sorted(points, key=lambda p: p["ts"]):
        flows = by_uid[p["args"]["uid"]]
        if not flows or p["args"]["step"] == ARRIVAL:
            flows.append([])
        flows[-1].append(p)
    out = []
    for flow_id, flow in enumerate((f for flows in by_uid.values() for f in flows), start=1):
        for i, p in enumerate(flow):
            p["id"] = flow_id
            p["ph"] = "s" if i == 0 else "f" if i == len(flow) - 1 else "t"
        flow[-1]["bp"] = "e"  # the end binds to the slice it is in, as the others do
        out += flow
    return out
