"""Server metrics in the Prometheus text format, under SGLang's names (`sglang:...`, labelled with
`model_name`) so that dashboards built for SGLang read minisgl unchanged; the figures SGLang has no
name for (request table rows, KV pages by owner, requests in flight, finishes by reason) keep
minisgl's own `minisgl_` names. docs/serving.md lists them all.

Request figures are counted here, in the API server, from the replies; the load figures are the
scheduler's, after its last step (`SchedulerStats`).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from minisgl.message.frontend import SchedulerStats

_OWN = "minisgl_"
_SGLANG = "sglang:"
_THROUGHPUT_WINDOW_S = 10.0  # sglang:gen_throughput is the rate over this last stretch of time
_BUCKET_S = 0.1  # its resolution


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        """Observe `value` `times` times (the tokens of one reply share one interval)."""
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += times
        self.total += value * times
        self.count += times

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        sep = "," if labels else ""
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"{sep}{labels}}} {cumulative}')
        tail = f"{{{labels}}}" if labels else ""
        lines += [
            f'{name}_bucket{{le="+Inf"{sep}{labels}}} {self.count}',
            f"{name}_sum{tail} {self.total}",
            f"{name}_count{tail} {self.count}",
        ]
        return lines


_TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    8.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 2400.0)

# minisgl's own gauges: SchedulerStats field -> (name, help)
_OWN_GAUGES = {
    "free_slots": ("free_request_slots", "request table rows free"),
    "kv_pages_total": ("kv_pages_total", "KV cache pages in the pool"),
    "kv_pages_free": ("kv_pages_free", "KV cache pages free"),
    "kv_pages_cached": ("kv_pages_cached", "KV cache pages kept by the prefix cache"),
    "kv_pages_held": ("kv_pages_held", "KV cache pages held by running requests alone"),
}


@dataclass
class Metrics:
    model_name: str = ""  # the `model_name` label of the sglang: figures
    in_flight: int = 0  # requests the server has sent on and not yet seen finish
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(_ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_E2E_BUCKETS))
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    # [bucket, tokens] pairs of _BUCKET_S-wide stretches for gen_throughput: at 256 streams a tuple per
    # reply (tens of thousands a second, kept 10 s) cost the API server's loop 7% of its time
    _recent: deque[list[int]] = field(default_factory=deque)

    def generated(self, now: float, tokens: int) -> None:
        """`tokens` new output tokens arrived at `now` (time.perf_counter())."""
        self.generation_tokens += tokens
        bucket = int(now / _BUCKET_S)
        if self._recent and self._recent[-1][0] == bucket:
            self._recent[-1][1] += tokens
            return
        self._recent.append([bucket, tokens])
        self._forget_before(bucket)

    def _forget_before(self, bucket: int) -> None:
        """Drop the stretches that ended before the window that closes with `bucket`."""
        first = bucket - round(_THROUGHPUT_WINDOW_S / _BUCKET_S) + 1
        while self._recent and self._recent[0][0] < first:
            self._recent.popleft()

    def gen_throughput(self, now: float) -> float:
        """Output tokens per second over the last _THROUGHPUT_WINDOW_S seconds (to within _BUCKET_S)."""
        self._forget_before(int(now / _BUCKET_S))
        return sum(n for _, n in self._recent) / _THROUGHPUT_WINDOW_S

    def render(self, now: float | None = None, body_bytes_held: int = 0) -> str:
        """The text format; `body_bytes_held` is the HTTP front end's figure (server/guard.py BodyBudget)."""
        now = time.perf_counter() if now is None else now
        labels = f'model_name="{_escape(self.model_name)}"' if self.model_name else ""
        lines: list[str] = []

        def one(name: str, kind: str, help_text: str, value: float, own: bool = False) -> None:
            full = f"{_OWN}{name}" if own else f"{_SGLANG}{name}"
            tail = "" if own or not labels else f"{{{labels}}}"
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full}{tail} {value}"])

        s = self.scheduler
        # a page shared by several requests is one page: used = neither free nor free to take back
        used_pages = s.kv_pages_total - s.kv_pages_free - s.kv_pages_evictable
        one("num_running_reqs", "gauge", "requests being decoded", s.running)
        one("num_queue_reqs", "gauge", "requests waiting for prefill", s.waiting)
        one("num_used_tokens", "gauge", "KV cache tokens in use by requests", used_pages * s.page_size)
        one("max_total_num_tokens", "gauge", "KV cache tokens in the pool", s.kv_pages_total * s.page_size)
        usage = used_pages / s.kv_pages_total if s.kv_pages_total else 0.0
        one("token_usage", "gauge", "share of the KV cache in use by requests", usage)
        hit_rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        one("cache_hit_rate", "gauge", "share of prompt tokens served from the prefix cache", hit_rate)
        one("gen_throughput", "gauge", "output tokens per second, last 10 s", self.gen_throughput(now))
        one("prompt_tokens_total", "counter", "prompt tokens of requests that started", self.prompt_tokens)
        one(
            "cached_tokens_total", "counter", "prompt tokens served from the prefix cache", self.cached_tokens
        )
        one("generation_tokens_total", "counter", "tokens generated", self.generation_tokens)
        one("num_requests_total", "counter", "requests finished", sum(self.finished.values()))
        one("num_aborted_requests_total", "counter", "requests aborted", self.finished["abort"])
        lines += self.ttft.render(
            f"{_SGLANG}time_to_first_token_seconds", "time from arrival to the first token", labels
        )
        lines += self.itl.render(
            f"{_SGLANG}inter_token_latency_seconds", "time between output tokens", labels
        )
        lines += self.e2e.render(
            f"{_SGLANG}e2e_request_latency_seconds", "time from arrival to the last token", labels
        )
        for attr, (name, help_text) in _OWN_GAUGES.items():
            one(name, "gauge", help_text, getattr(s, attr), own=True)
        one("requests_in_flight", "gauge", "requests accepted and not yet finished", self.in_flight, own=True)
        one(
            "request_body_bytes_held",
            "gauge",
            "bytes of request bodies read or being read and not yet parsed",
            body_bytes_held,
            own=True,
        )
        name = f"{_OWN}requests_finished_total"
        lines += [f"# HELP {name} requests finished, by finish reason", f"# TYPE {name} counter"]
        for reason in ("stop", "length", "abort", "error"):
            lines.append(f'{name}{{finish_reason="{reason}"}} {self.finished[reason]}')
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    """A label value as the text format needs it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
