"""SchedulerConfig: the engine's options plus the scheduler's own."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine.config import EngineConfig
from minisgl.utils.hf import read_chat_template


@dataclass
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"
    max_extend_tokens: int = 8192  # the prefill budget: prompt tokens computed in one step
    # a request sharing at least this many uncached prompt tokens with one admitted to the same prefill batch
    # waits a step to read them from the prefix cache instead of computing them twice (0: off)
    in_batch_prefix_share: int = 32
    # requests wait for prefill in the order of their priority, ties first come first served (SGLang's
    # --enable-priority-scheduling): higher values first, or lower with low_priority_values_first (SGLang's
    # --schedule-low-priority-values-first, vLLM's --scheduling-policy priority). Running requests are not
    # preempted: a priority orders the queue only. Off: first come first served, and a request's priority unused
    priority_scheduling: bool = False
    low_priority_values_first: bool = False
    # the chat template (a Jinja text, or a file's path) used instead of the tokenizer's: vLLM's and SGLang's
    # --chat-template. None: the tokenizer's own
    chat_template: str | None = None
    offline_mode: bool = False
    zmq_backend_addr: str = ""  # where rank 0 receives requests (online mode)
    zmq_detokenizer_addr: str = ""  # where rank 0 sends DetokenizeMsg replies (online mode)
    trace: str | None = None  # write a timeline of the run to this file (utils/trace.py); None: MINISGL_TRACE

    def validate(self) -> None:
        super().validate()
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if self.low_priority_values_first and not self.priority_scheduling:
            raise ValueError("low_priority_values_first orders priority scheduling, which is off; turn it on")
        if self.cache_type not in ("radix", "naive"):
            raise ValueError(f"cache_type={self.cache_type!r} is unknown; use 'radix' or 'naive'")
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens={self.max_extend_tokens} is invalid: it must be >= 1")
        if self.in_batch_prefix_share < 0:
            raise ValueError(
                f"in_batch_prefix_share={self.in_batch_prefix_share} is invalid: it must be >= 0 (0 turns it off)"
            )

    def queue_rank(self, priority: int) -> int:
        """A request's rank in the prefill queue (PendingReq.rank: lower first) from the priority it was sent with."""
        if not self.priority_scheduling:
            return 0
        return priority if self.low_priority_values_first else -priority
