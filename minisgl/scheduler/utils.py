"""Records the scheduler keeps between steps."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import ChunkedReq, SamplingParams


@dataclass
class PendingReq:
    """A request waiting for prefill; `chunked_req` is set while its prompt is being prefilled in chunks."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    # sampling_params.max_tokens cut to what the context length leaves (check_request)
    max_tokens: int
    chunked_req: ChunkedReq | None = None
    # the queue's order: a lower rank is admitted first, equal ranks in arrival order (0 for every request
    # without priority scheduling: first come first served)
    rank: int = 0
    cache_salt: str | None = None  # UserMsg.cache_salt

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.max_tokens


@dataclass
class CacheStats:
    """Prompt tokens served from the prefix cache versus computed, since the scheduler started."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens
