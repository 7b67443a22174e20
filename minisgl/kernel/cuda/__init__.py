"""CUDA C++ kernels compiled at run time by NVRTC and launched through the driver API.

Where a kernel wants what Triton does not give (decode attention over an FP8 pool: rows loaded straight into
registers and widened there, docs/benchmarks.md), it is written in CUDA C++ (`*.cu` beside this file). NVRTC,
the library torch's CUDA builds already depend on (the toolkit's, or the nvidia-cuda-nvrtc wheel's), compiles
it to a cubin for the device's architecture; the cubin is cached under MINISGL_CACHE_DIR, named by the
source's, the options' and NVRTC's hash, so only the first start on a machine compiles. Kernels are launched
with `cuLaunchKernel` on torch's current stream, so a CUDA graph being captured records them as it records
torch's own. Where NVRTC is missing or the driver refuses the cubin, `load_module` raises `CudaUnavailable`
and the callers keep their Triton kernels.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from minisgl.env import ENV

HERE = Path(__file__).parent
# options every program is compiled with: fast exp2 / log2 (the kernels' softmax works in base 2)
OPTIONS = ("--use_fast_math", "-std=c++17", "-default-device")


class CudaUnavailable(RuntimeError):
    """NVRTC or the driver cannot give a kernel here: the caller's Triton path runs instead."""


@cache
def nvrtc() -> ctypes.CDLL:
    """libnvrtc: from CUDA_HOME's toolkit or an nvidia-cuda-nvrtc wheel on sys.path (torch's CUDA wheels
    depend on one), or wherever the dynamic loader finds it."""
    names: list[str] = []
    roots = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64"), *sys.path]
    for root in roots:
        for pattern in ("nvidia/*/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*", "libnvrtc.so*"):
            names += sorted(glob.glob(os.path.join(root, pattern)))
    names += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for name in names:
        if "builtins" in name or "alt" in name:  # NVRTC's helper libraries, not NVRTC
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CudaUnavailable("libnvrtc was not found (install the CUDA toolkit or nvidia-cuda-nvrtc)")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_cubin(
    source: str, arch: str, options: Sequence[str] = (), name: str = "kernels.cu"
) -> tuple[bytes, str]:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90"): the cubin and NVRTC's log (ptxas's register
    report among it where options ask for it with --ptxas-options=-v)."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) != 0:
        raise CudaUnavailable("nvrtcCreateProgram failed")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in (*OPTIONS, *options))]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            # the source is the project's own: a failure here is a bug, or an NVRTC too old for the arch
            raise CudaUnavailable(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode()[:2000]}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cached_cubin(source: str, arch: str, name: str) -> bytes:
    """compile_cubin's cubin, from MINISGL_CACHE_DIR when this source, arch, options and NVRTC built it before."""
    digest = hashlib.sha256(f"{source}\0{arch}\0{OPTIONS}\0{nvrtc_version()}".encode()).hexdigest()[:16]
    folder = Path(ENV.CACHE_DIR.value) / "cuda_kernels"
    target = folder / f"{Path(name).stem}_{arch}_{digest}.cubin"
    if target.exists():
        return target.read_bytes()
    cubin, _ = compile_cubin(source, arch, name=name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # written beside the target, then renamed: processes compiling at once never read a half-written file
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".cubin", delete=False) as tmp:
            tmp.write(cubin)
        os.replace(tmp.name, target)
    except OSError:
        pass  # a read-only cache: compile again next time
    return cubin


@cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaUnavailable(f"the CUDA driver library could not be loaded: {e}") from e


# CUfunction_attribute values (cuda.h)
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SHARED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent of the L1 / shared total


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an enum id, padding to 8 bytes, a 64-byte union whose first int is the flag of
    the attributes used here. The flag is a field of its own: a c_char array field reads back as a copy, and a
    value written into that copy would leave the attribute 0."""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),
        ("rest", ctypes.c_char * 60),
    ]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class CudaModule:
    """A cubin loaded into the current CUDA context (torch's primary context: torch must have initialised
    CUDA first); its kernels launched on a torch stream."""

    def __init__(self, cubin: bytes) -> None:
        self.driver = _driver()
        self.module = ctypes.c_void_p()
        self._check(self.driver.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        self.functions: dict[str, ctypes.c_void_p] = {}

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CudaUnavailable(f"{what} failed with CUDA driver error {rc}")

    def function(self, name: str) -> ctypes.c_void_p:
        fn = self.functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            self._check(self.driver.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()), name)
            self.functions[name] = fn
        return fn

    def allow_shared(self, name: str, size: int) -> None:
        """Let `name` take `size` bytes of dynamic shared memory (over 48 KB needs the attribute), with as much of
        each SM's L1 given to shared memory as the hardware allows."""
        fn = self.function(name)
        self._check(
            self.driver.cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED, size), f"cuFuncSetAttribute({name})"
        )
        self._check(self.driver.cuFuncSetAttribute(fn, _SHARED_CARVEOUT, 100), f"cuFuncSetAttribute({name})")

    def launch(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: int,
        args: Sequence[Any],
        stream: int,
        shared: int = 0,
        programmatic: bool = False,
    ) -> None:
        """`args` in the kernel's order: ctypes values as they are, ints as pointers (data_ptr()); `shared`
        bytes of dynamic shared memory a block. `programmatic`: programmatic dependent launch (Hopper on), the
        kernel may start once the kernel before it on the stream lets it (griddepcontrol.launch_dependents), and
        must hold every read of that kernel's output behind griddepcontrol.wait."""
        holders = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_void_p(a) for a in args]
        # the driver takes an array of pointers to each argument's value
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        if not programmatic:
            rc = self.driver.cuLaunchKernel(
                self.function(name), *grid, block, 1, 1, shared, ctypes.c_void_p(stream), params, None
            )
            self._check(rc, f"cuLaunchKernel({name})")
            return
        attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = LaunchConfig(grid, (block, 1, 1), shared, ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
        rc = self.driver.cuLaunchKernelEx(ctypes.byref(cfg), self.function(name), params, None)
        self._check(rc, f"cuLaunchKernelEx({name})")


def load_module(source: str, name: str, device_index: int = 0) -> CudaModule:
    """`source` compiled for the device's architecture (or read from the cache) and loaded."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = cached_cubin(source, f"sm_{major}{minor}", name)
    with torch.cuda.device(device_index):
        torch.zeros(1, device=f"cuda:{device_index}")  # the device's primary context current on this thread
        return CudaModule(cubin)


def source(name: str) -> str:
    return (HERE / name).read_text()
