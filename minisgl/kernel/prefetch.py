"""A GEMM's weight asked into L2 by the small kernel launched before it (MINISGL_L2_PREFETCH).

A decode step's GEMMs read 4-12 MB of weights each and none takes under 5 us on an H200, though the bytes
need 1-3: the time is each kernel's ramp (its launch inside the graph, the first loads' DRAM latency),
and the GPU's memory sits idle while the RMSNorm or SiLU kernel before it runs (docs/benchmarks.md,
"Decode GEMMs of few rows"). The weights do not depend on that kernel's output, so it can ask for them:
extra programs of the norm and SiLU kernels issue `prefetch.global.L2` over the next GEMM's weight, a
128-byte line each, and the GEMM then finds its first tiles in L2 or on their way. The extra programs
come after the kernel's own, so their requests queue behind its loads, not before them.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

LINE = 128  # bytes a prefetch brings in
BLOCK = 512  # lines a program asks for in one go (four a thread with four warps)


@triton.jit
def prefetch_part(P, n_bytes, part, parts, BLOCK: tl.constexpr):
    """Ask part `part` of `parts` of the n_bytes at P (a byte pointer) into L2."""
    lines = tl.cdiv(n_bytes, 128)
    per = tl.cdiv(lines, parts)
    first = part * per
    last = tl.minimum(first + per, lines)
    for start in range(first, last, BLOCK):
        # clamped, not masked: inline assembly takes no mask, and a second request for a line costs nothing
        line = tl.minimum(start + tl.arange(0, BLOCK), last - 1).to(tl.int64)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            "=r,l",
            [P + line * 128],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@cache
def prefetch_programs(device: int) -> int:
    """Programs that share one prefetch: one an SM, so every SM's load unit issues a part."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def as_bytes(weight: torch.Tensor) -> torch.Tensor:
    """The weight's storage as bytes, the pointer the prefetch walks."""
    return weight.view(-1).view(torch.uint8)
