"""Programmatic edges in a captured CUDA graph: a kernel that waits for its inputs on the device
(`griddepcontrol.wait`) may start while the kernel before it is still running.

A kernel boundary inside a decode graph costs about 0.8 us, and each kernel's first reads ramp up after it
(docs/benchmarks.md, "A decode GEMM on the tensor cores, and what a step's weight reads cost"). Hopper lets a
graph edge be programmatic: the consumer launches once the producer's programs have all called
`griddepcontrol.launch_dependents` (or ended), and its `griddepcontrol.wait` holds it until the producer has
finished and its writes are visible. An edge may be made so only where the consumer waits before it reads
its inputs; a kernel that does not would read them early. Which kernels wait is the caller's to say, by name
(`waits`); every other edge stays as captured.

The graph is torch's, captured with `keep_graph=True` and changed before `instantiate()`, through the driver
API (the `_v2` entry points with edge data, CUDA 12.3 on).
"""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# this project's kernels that wait for their inputs first when MINISGL_PDL_KERNELS is on: the decode step's Triton
# kernels (kernel/launch.py's wait_for_inputs) and the CUDA decode kernels (decode_common.cuh's)
OWN_WAITERS = (
    r"^(_rope_kernel|_silu_and_mul_kernel|_gemm_kernel|_decode_kernel|_decode_merge_kernel|_rms_norm_kernel"
    r"|decode_(tc_)?(bf16|fp8)_g\d+_\w+)$"
)
# the CUDA GEMM (kernel/cuda/gemm.py) waits whatever the switch says
ALWAYS_WAITS = r"^gemm_n\d+_m\d+_w\d+x\d+_s\d+_p\d+$"
# the largest product (weight elements) of a model whose decode graphs take programmatic edges: the CUDA GEMM's
# bound (kernel/cuda/gemm.py's MAX_WEIGHT), measured on the same two models
MAX_SHORT_PRODUCT = 8 << 20
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: when the producer's programs let it
_DEPENDENCY_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h)."""

    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h): the function, or the library kernel when the launch named one."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class EdgeReport:
    """What a pass over one graph found and changed."""

    kernels: int
    edges: int
    made_programmatic: int
    names: Counter[str]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {rc}")


def kernel_name(driver: ctypes.CDLL, node: int) -> str | None:
    """The kernel's (mangled) name, or None for a node that is not a kernel."""
    kind = ctypes.c_int()
    _check(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _KERNEL_NODE:
        return None
    p = KernelNodeParams()
    _check(
        driver.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)),
        "cuGraphKernelNodeGetParams",
    )
    name = ctypes.c_char_p()
    if p.func:
        rc = driver.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func))
    else:
        rc = driver.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern))
    # a kernel whose name cannot be read is named "": no pattern of waiters matches it, its edges stay
    return (name.value or b"").decode(errors="replace") if rc == 0 else ""


def edges(driver: ctypes.CDLL, graph: int) -> list[tuple[int, int, EdgeData]]:
    """Every edge of `graph`: (from, to, its data)."""
    n = ctypes.c_size_t()
    _check(
        driver.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)),
        "cuGraphGetEdges",
    )
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (EdgeData * n.value)()
    _check(
        driver.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)), "cuGraphGetEdges"
    )
    return [(src[i] or 0, dst[i] or 0, data[i]) for i in range(n.value)]


def make_programmatic(graph: int, waits: Callable[[str], bool]) -> EdgeReport:
    """Each kernel-to-kernel edge of `graph` whose consumer `waits` (by its name) made programmatic."""
    from minisgl.kernel.cuda import _driver

    driver = _driver()
    all_edges = edges(driver, graph)
    names: dict[int, str | None] = {}

    def name_of(node: int) -> str | None:
        if node not in names:
            names[node] = kernel_name(driver, node)
        return names[node]

    changed = 0
    one = ctypes.c_size_t(1)  # a size_t argument: ctypes would pass a bare 1 as a 32-bit int
    for src, dst, data in all_edges:
        producer, consumer = name_of(src), name_of(dst)
        if producer is None or consumer is None or data.type != 0 or not waits(consumer):
            continue
        pair = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        _check(
            driver.cuGraphRemoveDependencies_v2(ctypes.c_void_p(graph), *pair, ctypes.byref(data), one),
            "cuGraphRemoveDependencies",
        )
        new = EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=_DEPENDENCY_PROGRAMMATIC)
        rc = driver.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), *pair, ctypes.byref(new), one)
        if rc != 0:  # the edge back as it was, so that a refusal leaves a correct graph
            driver.cuGraphAddDependencies_v2(ctypes.c_void_p(graph), *pair, ctypes.byref(data), one)
            _check(rc, "cuGraphAddDependencies")
        changed += 1
    kernels = Counter(n for n in names.values() if n is not None)
    return EdgeReport(sum(kernels.values()), len(all_edges), changed, kernels)


def waiters_pattern(setting: str, pdl_kernels: int) -> str:
    """MINISGL_GRAPH_PDL's pattern: 'own' names this project's kernels that wait, the CUDA GEMM always and the
    others only where MINISGL_PDL_KERNELS has them wait (an edge made programmatic into a kernel that does not
    wait would let it read its input early); anything else is a regular expression as it is."""
    if setting != "own":
        return setting
    return f"{OWN_WAITERS}|{ALWAYS_WAITS}" if pdl_kernels >= 1 else ALWAYS_WAITS


def graph_pattern(rows: int, short_products: bool = True) -> str:
    """The waiters whose edges are made programmatic in a graph whose products take `rows` rows: MINISGL_GRAPH_PDL
    in graphs of at most MINISGL_GRAPH_PDL_ROWS rows of a model whose products are short (`short_products`),
    none elsewhere."""
    from minisgl.env import ENV

    if rows > ENV.GRAPH_PDL_ROWS.value or not short_products:
        return ""
    return waiters_pattern(ENV.GRAPH_PDL.value, ENV.PDL_KERNELS.value)


def short_products(model: Any) -> bool:
    """Whether every product of the model's layers reads at most MAX_SHORT_PRODUCT weight elements (the LM head
    apart): where the edges pay. On an H100 the programmatic edges took 3-5% off a Qwen3-0.6B decode step of 1-8
    rows (products of 1-6M elements, a few microseconds each) and added 1.1-2.4% to a Llama-3-8B one (17-117M
    elements), whose kernels are long and whose early-launched waiting programs hold SMs the running products
    need (docs/benchmarks.md, "Programmatic edges by the model's product size")."""
    from minisgl.layers.embedding import VocabParallelEmbedding
    from minisgl.layers.linear import QuantizableLinear

    sizes = [
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, QuantizableLinear)
        and not isinstance(m, VocabParallelEmbedding)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    return bool(sizes) and max(sizes) <= MAX_SHORT_PRODUCT


def name_matcher(pattern: str) -> Callable[[str], bool]:
    """A `waits` from a regular expression searched in the kernel's name ('' matches nothing)."""
    if not pattern:
        return lambda name: False
    rx = re.compile(pattern)
    return lambda name: rx.search(name) is not None
