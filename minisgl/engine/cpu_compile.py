"""A CPU decode step compiled with `torch.compile` (inductor): the layers' Python, casts and small ops
turned into inductor's generated code, fused C++ loops between the matmuls and the attention kernel.

Opt-in (`MINISGL_CPU_COMPILE=1`): it gained at most 5% a step on the default model while a process paid
95 s to compile with inductor's on-disk cache cold and 34 s with it warm (docs/benchmarks.md, "The CPU
decode step compiled"). Only decode steps are compiled; prefill, whose shapes change
every step, stays eager. The C kernels enter the graph as `torch.ops.minisgl.*` (kernel/cpu/ops.py);
RMSNorm and rotary are left to inductor as torch ops, which it fuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from minisgl.core import Batch
from minisgl.env import ENV
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


class CompiledDecode:
    """The model's forward, compiled for decode batches where the engine runs on the CPU and asks for it."""

    def __init__(
        self, forward: Callable[[], torch.Tensor], device: torch.device, attn_backend: object, tp_size: int
    ) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        if not ENV.CPU_COMPILE:
            return
        from minisgl.attention.cpu_backend import CpuAttnBackend

        if device.type != "cpu" or not isinstance(attn_backend, CpuAttnBackend) or tp_size > 1:
            logger.warning_rank0(
                "MINISGL_CPU_COMPILE applies to a CPU engine of one rank with the 'cpu' attention backend; "
                f"this one runs on {device} with {type(attn_backend).__name__} and {tp_size} rank(s): "
                "its decode steps stay eager"
            )
            return
        import minisgl.kernel.cpu.ops  # noqa: F401 - registers torch.ops.minisgl.*

        # dynamic sizes: besides batch size 1, which dynamo always specialises, one graph serves every
        # size between the row counts the linear layers branch on (2 and 4: packed or float weights)
        self.fn = torch.compile(forward, dynamic=True, fullgraph=True)

    @property
    def enabled(self) -> bool:
        return self.fn is not None

    def can_use(self, batch: Batch) -> bool:
        return self.fn is not None and batch.is_decode

    def run(self) -> torch.Tensor:
        assert self.fn is not None
        return self.fn()

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Decode steps run eager inside: a benchmark compares both in one process, under the same load."""
        fn, self.fn = self.fn, None
        try:
            yield
        finally:
            self.fn = fn

    def close(self) -> None:
        """Forgets the compiled graphs: dynamo counts another model's forward as a recompilation of the
        same code and, past its limit, would leave a later engine of the process eager."""
        if self.fn is not None:
            self.fn = None
            torch.compiler.reset()
