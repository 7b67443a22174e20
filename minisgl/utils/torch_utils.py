"""Device, stream and dtype helpers that hide the CPU/CUDA difference from the rest of the code."""

from __future__ import annotations

from array import array
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from its name; "auto" (or None) stays None, resolved once the device is known."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use auto or one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The model dtype for "auto": bf16 on CUDA; on a CPU, whichever of bf16 and float32 multiplies faster here."""
    if dtype is not None:
        return dtype
    if device.type == "cuda":
        return torch.bfloat16
    from minisgl.utils.cpu_probe import cpu_choice

    return cpu_choice().dtype


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def pin(device: torch.device) -> bool:
    """Pinned host memory makes host-to-device copies asynchronous; it only exists beside CUDA."""
    return device.type == "cuda"


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints (int64 or int32), through array.array: torch.tensor looks at every
    element on its own and took about 4x as long for the hundreds of ints of a step's metadata (43 against 12 us
    for 768 on a 2-vCPU machine), which the scheduler builds several times a step."""
    if not values:
        return torch.empty(0, dtype=dtype)
    # the tensor holds the array's memory and keeps the array alive
    return torch.frombuffer(array(_ARRAY_CODES[dtype], values), dtype=dtype)


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting: from pageable memory the host would wait for
    the stream before staging the copy, so beside CUDA the tensor goes through pinned memory first."""
    return (t.pin_memory() if pin(device) else t).to(device, non_blocking=True)


def create_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def set_stream(stream: Any) -> None:
    if stream is not None:
        torch.cuda.set_stream(stream)


class CopyDone:
    """Marks when a device-to-host copy has landed; on the CPU it is always done."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        if self.event is not None:
            self.event.record()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
