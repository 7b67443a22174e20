from minisgl.llm.llm import LLM, RequestAllFinished

__all__ = ["LLM", "RequestAllFinished"]
