"""The offline interface. LLM pulls in torch and transformers, so it is imported only when asked for:
`python -m minisgl generate --help` (minisgl.llm.cli) answers without them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.llm.llm import LLM, RequestAllFinished
    from minisgl.llm.outputs import CompletionOutput, RequestOutput
    from minisgl.llm.progress import GenerationInterrupted

__all__ = ["LLM", "CompletionOutput", "GenerationInterrupted", "RequestAllFinished", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestAllFinished"):
        import minisgl.llm.llm

        return getattr(minisgl.llm.llm, name)
    if name == "GenerationInterrupted":
        from minisgl.llm.progress import GenerationInterrupted

        return GenerationInterrupted
    if name in ("CompletionOutput", "RequestOutput"):  # the outputs' types (no torch)
        import minisgl.llm.outputs

        return getattr(minisgl.llm.outputs, name)
    raise AttributeError(name)
