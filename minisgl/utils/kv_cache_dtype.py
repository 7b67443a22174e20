"""The names `kv_cache_dtype` takes (LLM argument, `--kv-cache-dtype` flag), kept free of torch for `--help`.

They are the names SGLang and vLLM take for the formats minisgl stores: "auto" is the model's dtype,
"bf16"/"bfloat16" a bf16 cache, and "fp8"/"fp8_e4m3" an FP8 (e4m3) cache with a float32 scale per
layer for K and one for V (minisgl/kvcache/mha_pool.py).
"""

from __future__ import annotations

from typing import Any

KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3")
FP8_NAMES = ("fp8", "fp8_e4m3")


def check_kv_cache_dtype(value: str | None) -> str | None:
    """The name checked and made canonical ("auto" and None become None, "bf16" "bfloat16", "fp8"
    "fp8_e4m3"). An unknown name is refused, naming the choices."""
    if value is None or value == "auto":
        return None
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if value in FP8_NAMES:
        return "fp8_e4m3"
    return "bfloat16"


def resolve_kv_cache_dtype(value: Any) -> Any:
    """The pool's torch dtype for a name or a dtype; None (auto) stays None: the model's dtype, known later.

    A torch dtype is taken as it is, so code and tests can ask for a float32 or float16 cache too.
    """
    import torch

    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            raise ValueError(
                f"kv_cache_dtype={value} is not supported; use float32, bfloat16, float16 or float8_e4m3fn"
            )
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    name = check_kv_cache_dtype(value)
    if name is None:
        return None
    return torch.float8_e4m3fn if name == "fp8_e4m3" else torch.bfloat16
