"""minisgl: a compact, fast LLM inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams

if TYPE_CHECKING:
    from minisgl.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch models and transformers; import it only when asked for
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
