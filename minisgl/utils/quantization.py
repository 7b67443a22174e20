"""The names `quantization` takes (LLM argument, `--quantization` flag), kept free of torch for `--help`.

What each one does is in minisgl/models/quantize.py.
"""

from __future__ import annotations

QUANTIZATIONS = ("auto", "none", "int8", "w8a8", "gguf")


def check_quantization(value: str | None) -> str | None:
    """The quantization name checked; "auto" becomes None. An unknown name is refused, naming the choices."""
    if value is None or value == "auto":
        return None
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization={value!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    return value
