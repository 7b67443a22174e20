"""minisgl.kernel.launch.Launcher on a GPU: run with `pytest -m gpu`.

The launcher keys compiled kernels by Triton's own specialisation of the arguments, so a pointer that is
not 16-byte aligned, or an integer that is 1 or a multiple of 16, gets its own kernel, as under Triton's
JIT call; a launch inside CUDA graph capture goes to the capturing stream.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _norm_args(rows: int, offset: int) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """The RMSNorm kernel's arguments over `rows` rows of 1000 (not a multiple of 16) read `offset`
    elements into a buffer, so the pointer is 16-byte aligned only for offsets that are multiples of 8."""
    n = 1000
    buf = torch.randn(rows * n + offset, dtype=torch.bfloat16, device="cuda")
    x = buf[offset:].view(rows, n)
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    args = (x, x, y, y, w, rows, 1, n, 0, n, n, n, 1e-6)
    return args, x, y


def _launch(kernel, args, rows: int) -> None:
    kernel[(rows,)](*args, N=1000, BLOCK_N=1024, ROWS=1, HAS_RES=False, num_warps=4)


def _direct():
    """The RMSNorm kernel behind a launcher of its own that takes the direct path whatever
    MINISGL_DIRECT_LAUNCH says (the engine's launchers were made when minisgl was imported)."""
    from minisgl.kernel.launch import Launcher
    from minisgl.kernel.norm import _rms_norm_kernel

    return Launcher(_rms_norm_kernel.fn, direct=True)


@pytest.mark.parametrize("rows,offset", [(16, 0), (16, 3), (1, 0), (17, 1)])
def test_launcher_writes_what_triton_writes(rows: int, offset: int) -> None:
    launcher = _direct()
    args, _, y = _norm_args(rows, offset)
    _launch(launcher.fn, args, rows)
    want = y.clone()
    y.zero_()
    for _ in range(2):  # the first launch of a key goes through Triton, the second is direct
        _launch(launcher, args, rows)
    torch.cuda.synchronize()
    assert torch.equal(y, want)


def test_specialisation_gives_separate_kernels() -> None:
    launcher = _direct()
    for rows, offset in ((16, 0), (32, 0), (16, 3), (16, 0)):
        _launch(launcher, _norm_args(rows, offset)[0], rows)
    torch.cuda.synchronize()
    # 16 and 32 rows share one key (both multiples of 16), the unaligned pointer has its own
    assert len(launcher.kernels) == 2


def test_launcher_inside_graph_capture() -> None:
    launcher = _direct()
    args, x, y = _norm_args(16, 0)
    _launch(launcher, args, 16)
    _launch(launcher, args, 16)
    torch.cuda.synchronize()
    want = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(launcher, args, 16)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    x.mul_(2)  # the replay reads the new input: the captured launch is the kernel's, on the graph's stream
    graph.replay()
    _launch(launcher.fn, args, 16)  # overwrites y with the JIT's result of the doubled input
    got = y.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, got)


def test_launch_hook_takes_tritons_path() -> None:
    """With a profiler's launch hook installed every launch goes through Triton, which calls the hook."""
    from triton import knobs

    launcher = _direct()
    args, _, _ = _norm_args(16, 0)
    _launch(launcher, args, 16)  # compiled and keyed
    seen: list[object] = []
    chain = knobs.runtime.launch_enter_hook  # a HookChain in Triton 3.6 and later
    chain.add(seen.append)
    try:
        _launch(launcher, args, 16)
        _launch(launcher, args, 16)
    finally:
        chain.remove(seen.append)
    torch.cuda.synchronize()
    assert len(seen) == 2
