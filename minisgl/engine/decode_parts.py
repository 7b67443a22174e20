"""Decode graphs of many rows captured as two parts: one half of the batch attends while the other's
products run.

Why: from about 64 rows a decode step's attention streams its KV at the copy rate, while its 112 products
and the small kernels between them read the weights at about a quarter of it, each kernel's time mostly its
ramp and tail (docs/benchmarks.md, "A decode GEMM on the tensor cores"). The two halves of a batch are
independent until the LM head, so a graph whose halves are two chains of kernels on two streams lets one
half's latency-bound kernels run beside the other half's bandwidth-bound attention, for the price of reading
the weights twice. Captured that way alone the halves added up instead ("Two parts of a batch on two
streams"): attention's many programs, launched first, took every SM slot as it freed. So every kernel but
attention's gets the device's greatest priority (`MINISGL_DECODE_PARTS_PRIORITY`), and the graph is
instantiated to honour its nodes' priorities: a product's programs go before attention's waiting ones.

The halves' hidden states meet before the LM head, which runs once over the whole batch. Only where the
layers are the dense decoder's (`hidden_states` / `logits`), without tensor parallelism (two parts' all-reduces
on two streams could meet in different orders on different ranks) and on the Triton attention backend
(its metadata in one static buffer, sliced by part).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from minisgl.core import Batch, get_global_ctx

# the decode attention kernels (Triton's, its merge, the CUDA and tensor-core ones): the bandwidth-bound
# programs that wait behind every other kernel's
ATTENTION_KERNELS = r"^(_decode_kernel|_decode_merge_kernel|decode_(tc_)?(bf16|fp8)_g\d+_\w+)$"
_PRIORITY_ATTRIBUTE = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY
_USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
PART_ALIGN = 8  # rows: keeps each part's int32 metadata and int64 inputs 16-byte aligned


def part_split(bs: int, parts_from: int) -> int:
    """The first part's rows of a decode graph of `bs` rows captured in two parts (the second takes the rest),
    or 0 where it is captured whole: batches of at least `parts_from` rows (MINISGL_DECODE_PARTS; 0: never),
    halves rounded down to whole blocks of PART_ALIGN rows."""
    if parts_from <= 0 or bs < max(parts_from, 2 * PART_ALIGN):
        return 0
    return bs // 2 // PART_ALIGN * PART_ALIGN


def supports_parts(model: torch.nn.Module, tp_size: int) -> bool:
    """Dense decoders on one device (an MoE layer's routing buffers are shared by every call)."""
    dense = not getattr(getattr(model, "config", None), "num_experts", 0)
    return tp_size == 1 and dense and hasattr(model, "hidden_states") and hasattr(model, "logits")


def part_batches(batch: Batch, split: int) -> list[Batch]:
    """`batch`'s two parts as batches of their own, their inputs views of the whole batch's (set by the caller
    before a forward: see PartedForward)."""
    reqs = batch.padded_reqs
    return [Batch(reqs=reqs[:split], phase="decode"), Batch(reqs=reqs[split:], phase="decode")]


class PartedForward:
    """A decode step's forward over two parts of the batch, each part's layers on its own stream (on CUDA; one
    after the other on a CPU, where an emulated graph replays it), the LM head over both."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.streams: list[torch.cuda.Stream] | None = (
            [torch.cuda.Stream(device), torch.cuda.Stream(device)] if device.type == "cuda" else None
        )

    def __call__(self, batch: Batch, parts: list[Batch]) -> torch.Tensor:
        ctx = get_global_ctx()
        start = 0
        for part in parts:  # the inputs, as views: a graph reads them where the whole batch's are copied
            end = start + part.padded_size
            part.input_ids = batch.input_ids[start:end]
            part.positions = batch.positions[start:end]
            part.out_loc = batch.out_loc[start:end]
            start = end
        hidden: list[torch.Tensor] = []
        main = torch.cuda.current_stream() if self.streams is not None else None
        for i, part in enumerate(parts):
            stream = self.streams[i] if self.streams is not None else None
            if stream is not None:
                stream.wait_stream(main)  # type: ignore[arg-type]
            with torch.cuda.stream(stream) if stream is not None else nullcontext(), ctx.replaying(part):
                hidden.append(self.model.hidden_states())
        if self.streams is not None:
            for stream in self.streams:
                main.wait_stream(stream)  # type: ignore[union-attr]
        return self.model.logits(torch.cat(hidden))


def set_priorities(graph: int, high: Callable[[str], bool]) -> tuple[int, int]:
    """Every kernel node of `graph` (a raw cudaGraph_t) that `high` names at the device's greatest priority, the
    others at its least; returns (high, low) counts."""
    from minisgl.engine.graph_edges import _check, kernel_name
    from minisgl.kernel.cuda import _driver

    driver = _driver()
    least, greatest = ctypes.c_int(), ctypes.c_int()
    _check(driver.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)), "priority range")
    n = ctypes.c_size_t()
    _check(driver.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(driver.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n)), "cuGraphGetNodes")
    counts = [0, 0]
    for node in nodes:
        name = kernel_name(driver, node or 0)
        if name is None:
            continue
        is_high = high(name)
        value = _AttrValue(priority=greatest.value if is_high else least.value)
        _check(
            driver.cuGraphKernelNodeSetAttribute(
                ctypes.c_void_p(node), ctypes.c_int(_PRIORITY_ATTRIBUTE), ctypes.byref(value)
            ),
            "cuGraphKernelNodeSetAttribute",
        )
        counts[0 if is_high else 1] += 1
    return counts[0], counts[1]


class _AttrValue(ctypes.Structure):
    """CUlaunchAttributeValue (cuda.h): a 64-byte union; the priority is its first int."""

    _fields_ = [("priority", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class PriorityGraph:
    """A captured graph instantiated to honour its kernel nodes' priorities (torch's `instantiate` does not pass
    the flag), replayed on the current stream. The torch graph stays alive for its memory pool."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        from minisgl.engine.graph_edges import _check
        from minisgl.kernel.cuda import _driver

        self.graph, self.driver = graph, _driver()
        self.exec = ctypes.c_void_p()
        _check(
            self.driver.cuGraphInstantiateWithFlags(
                ctypes.byref(self.exec), ctypes.c_void_p(graph.raw_cuda_graph()),
                ctypes.c_ulonglong(_USE_NODE_PRIORITY),
            ),
            "cuGraphInstantiateWithFlags",
        )  # fmt: skip

    def replay(self) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.driver.cuGraphLaunch(self.exec, ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuGraphLaunch failed with CUDA driver error {rc}")

    def pool(self) -> Any:
        return self.graph.pool()

    def __del__(self) -> None:
        if getattr(self, "exec", None) and self.exec.value:
            self.driver.cuGraphExecDestroy(self.exec)
            self.exec = ctypes.c_void_p()


def attention_matcher() -> Callable[[str], bool]:
    """`high` for set_priorities: every kernel that is not decode attention's."""
    rx = re.compile(ATTENTION_KERNELS)
    return lambda name: rx.search(name) is None
