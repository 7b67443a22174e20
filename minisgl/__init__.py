"""minisgl: a compact, fast LLM inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # both pull in torch (LLM also models and transformers): `python -m minisgl --help` must not wait for them
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl.core import SamplingParams

        return SamplingParams
    raise AttributeError(name)
