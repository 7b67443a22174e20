"""CudaModule.launch (minisgl/kernel/cuda): the driver receives the grid, block, stream and arguments it is given,
and a programmatic launch carries its attribute as cuda.h lays it out (any machine: the driver is faked)."""

from __future__ import annotations

import ctypes
from typing import Any

from minisgl.kernel import cuda as cuda_kernels


class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def cuLaunchKernel(self, fn: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: Any, params: Any, extra: Any) -> int:  # fmt: skip
        self.calls.append(
            (
                "plain",
                (
                    (gx, gy, gz),
                    bx,
                    shared,
                    stream.value,
                    ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int)).contents.value,
                ),
            )
        )
        return 0

    def cuLaunchKernelEx(self, cfg_ref: Any, fn: Any, params: Any, extra: Any) -> int:
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(cuda_kernels.LaunchConfig)).contents
        attr = cfg.attrs[0]
        raw = ctypes.string_at(ctypes.addressof(attr), ctypes.sizeof(attr))
        arg = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int)).contents.value
        self.calls.append(
            ("ex", (tuple(cfg.grid), cfg.block[0], cfg.shared, cfg.stream, cfg.num_attrs, raw, arg))
        )
        return 0


def _module() -> tuple[cuda_kernels.CudaModule, FakeDriver]:
    module = cuda_kernels.CudaModule.__new__(cuda_kernels.CudaModule)
    driver = FakeDriver()
    module.driver = driver
    module.functions = {"k": ctypes.c_void_p(1)}
    return module, driver


def test_a_programmatic_launch_carries_its_attribute_as_cuda_h_lays_it_out() -> None:
    module, driver = _module()
    module.launch("k", (3, 2, 1), 128, (ctypes.c_int32(7),), stream=0x1234, shared=4096, programmatic=True)
    kind, (grid, block, shared, stream, num_attrs, raw, arg) = driver.calls[0]
    assert kind == "ex" and grid == (3, 2, 1) and block == 128 and shared == 4096 and stream == 0x1234
    assert num_attrs == 1 and arg == 7
    # 72 bytes: the id (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 6) at 0, the flag 1 at 8
    assert len(raw) == 72
    assert int.from_bytes(raw[0:4], "little") == 6
    assert int.from_bytes(raw[8:12], "little") == 1


def test_a_plain_launch_goes_through_cuLaunchKernel() -> None:
    module, driver = _module()
    module.launch("k", (5, 1, 1), 64, (ctypes.c_int32(9),), stream=0x99, shared=0)
    assert driver.calls == [("plain", ((5, 1, 1), 64, 0, 0x99, 9))]
