"""Messages into the scheduler (from the tokenizer worker, or from LLM in offline mode)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import SamplingParams


@dataclass
class BaseBackendMsg:
    pass


@dataclass
class UserMsg(BaseBackendMsg):
    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    # the request's place in the prefill queue under priority scheduling, as the client sent it (the
    # scheduler's config says whether high or low values go first); 0 without
    priority: int = 0
    # vLLM's cache_salt: the request shares cached prefixes only with requests of the same salt (None: the
    # unsalted requests), so that no client can learn from its cache hits what another's prompts were
    cache_salt: str | None = None


@dataclass
class AbortBackendMsg(BaseBackendMsg):
    uid: int


@dataclass
class ExitMsg(BaseBackendMsg):
    pass


@dataclass
class FlushCacheMsg(BaseBackendMsg):
    """Empty the prefix cache (SGLang's /flush_cache, vLLM's /reset_prefix_cache): from the API server through the
    tokenizer worker to the scheduler, which answers with a FlushCacheReply of the same uid."""

    uid: int


@dataclass
class BatchBackendMsg(BaseBackendMsg):
    data: list[BaseBackendMsg] = field(default_factory=list)
