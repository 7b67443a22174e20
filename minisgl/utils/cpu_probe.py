"""What `dtype="auto"` and the default quantization mean on this CPU, decided by timing matmuls here.

CPUs of one family differ: with AMX a bf16 matmul runs at ~2 TFLOP/s on two cores, with AVX512-BF16
only the dot products are native, and without either bf16 is emulated and several times slower than
float32. The flags say which units exist, not how fast torch's kernels use them, so a short timing
(0.2-0.5 s, once a process, on one thread) decides: bf16 against float32 at a batch of 16 rows, a
packed int4 weight against the faster of them at one row, and W8A8 (int8 activations a row times int8
weights, `layers.quant.W8A8Weight`) against bf16 at 64 rows, for the prompts and batches of a packed
model. The reason is logged once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class CpuChoice:
    dtype: torch.dtype
    packed_weights: bool  # whether a packed int4 weight beats the float one for a single decode stream
    w8a8_batches: bool  # whether W8A8 beats the bf16 matmul on 64-row batches by W8A8_MARGIN
    reason: str


# W8A8 replaces a packed model's float weights where it takes at most this share of bf16's time: it
# rounds the activations, so a near tie is not worth it (measured 0.6-0.7 on AVX512-VNNI without AMX)
W8A8_MARGIN = 0.85


def _best_us(fn: Callable[[], object], reps: int = 9) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _cpu_units() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    units = [u for u in ("amx_bf16", "avx512_bf16") if u in flags]
    return "+".join(units) or "no bf16 units"


@functools.cache
def cpu_choice() -> CpuChoice:
    # one thread: on a busy machine a multi-threaded call waits for its slowest thread (whole scheduler
    # quanta, measured 20 ms), which hides the kernels' speed; what is compared here is their ratio
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choice = _measure()
    finally:
        torch.set_num_threads(threads)
    logger.info(
        f"CPU: dtype auto is {str(choice.dtype).removeprefix('torch.')}, a GGUF file's packed weights are "
        f"{'used for small batches' if choice.packed_weights else 'not used'} by default"
        f"{', with W8A8 for prompts and large batches' if choice.packed_weights and choice.w8a8_batches else ''}"
        f" ({choice.reason})"
    )
    return choice


def _measure() -> CpuChoice:
    from minisgl.layers.linear import linear, linear_onednn, onednn_packing_supported, pack_onednn
    from minisgl.layers.quant import Int4Weight, W8A8Weight

    gen = torch.Generator().manual_seed(0)
    # a 1024 x 3072 layer: the size of a small model's MLP, larger than the L2 of a core
    w = torch.randn(3072, 1024, generator=gen) * 0.02
    x16 = torch.randn(16, 1024, generator=gen)
    wb, xb16 = w.to(torch.bfloat16), x16.to(torch.bfloat16)
    f32_us = _best_us(lambda: F.linear(x16, w))
    bf16_us = _best_us(lambda: F.linear(xb16, wb))
    dtype = torch.bfloat16 if bf16_us < f32_us else torch.float32
    x1, w1 = x16[:1].to(dtype), w.to(dtype)
    float_one_us = _best_us(lambda: linear(x1, w1))
    packed = Int4Weight.from_float(w)
    packed_one_us = _best_us(lambda: packed.matmul(x1))
    # 64 rows: bf16 as the engine runs it (oneDNN's layout where it packs), against W8A8 with its two ends
    x64 = torch.randn(64, 1024, generator=gen).to(torch.bfloat16)
    if onednn_packing_supported():
        wp = pack_onednn(wb)
        bf16_64_us = _best_us(lambda: linear_onednn(x64, wp))
    else:
        bf16_64_us = _best_us(lambda: F.linear(x64, wb))
    w8a8 = W8A8Weight.from_float(w)
    w8a8_64_us = _best_us(lambda: w8a8.matmul(x64))
    return CpuChoice(
        dtype,
        packed_one_us < float_one_us,
        dtype == torch.bfloat16 and w8a8_64_us <= W8A8_MARGIN * bf16_64_us,
        f"{_cpu_units()}, one thread: 16x1024x3072 matmul bf16 {bf16_us:.0f} us, float32 {f32_us:.0f} us; "
        f"one row {str(dtype).removeprefix('torch.')} {float_one_us:.0f} us, int4 {packed_one_us:.0f} us; "
        f"64 rows bf16 {bf16_64_us:.0f} us, w8a8 {w8a8_64_us:.0f} us",
    )
