"""Server metrics in the Prometheus text format: request and token counters, latency histograms,
and the scheduler's load (requests running and waiting, table rows, KV pages) after its last step."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field, fields

from minisgl.message.frontend import SchedulerStats

_PREFIX = "minisgl_"


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.total}",
            f"{name}_count {self.count}",
        ]
        return lines


_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)

_SCHEDULER_GAUGES = {
    "running": ("num_requests_running", "requests being decoded"),
    "waiting": ("num_requests_waiting", "requests waiting for prefill"),
    "free_slots": ("free_request_slots", "request table rows free"),
    "kv_pages_total": ("kv_pages_total", "KV cache pages in the pool"),
    "kv_pages_free": ("kv_pages_free", "KV cache pages free"),
    "kv_pages_cached": ("kv_pages_cached", "KV cache pages kept by the prefix cache"),
    "kv_pages_held": ("kv_pages_held", "KV cache pages held by running requests"),
}


@dataclass
class Metrics:
    in_flight: int = 0  # requests the server has sent on and not yet seen finish
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)

    def render(self) -> str:
        lines: list[str] = []

        def one(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend([f"# HELP {_PREFIX}{name} {help_text}", f"# TYPE {_PREFIX}{name} {kind}"])
            lines.append(f"{_PREFIX}{name} {value}")

        for f in fields(SchedulerStats):
            name, help_text = _SCHEDULER_GAUGES[f.name]
            one(name, "gauge", help_text, getattr(self.scheduler, f.name))
        one("requests_in_flight", "gauge", "requests accepted and not yet finished", self.in_flight)
        one("prompt_tokens_total", "counter", "prompt tokens of requests that started", self.prompt_tokens)
        one(
            "cached_prompt_tokens_total",
            "counter",
            "prompt tokens served from the prefix cache",
            self.cached_tokens,
        )
        one("generation_tokens_total", "counter", "tokens generated", self.generation_tokens)
        name = f"{_PREFIX}requests_finished_total"
        lines += [f"# HELP {name} requests finished, by finish reason", f"# TYPE {name} counter"]
        for reason in ("stop", "length", "abort", "error"):
            lines.append(f'{name}{{finish_reason="{reason}"}} {self.finished[reason]}')
        lines += self.ttft.render(
            f"{_PREFIX}time_to_first_token_seconds", "time from arrival to the first token"
        )
        lines += self.e2e.render(
            f"{_PREFIX}e2e_request_latency_seconds", "time from arrival to the last token"
        )
        return "\n".join(lines) + "\n"
